"""What runs: kernel implementations and their registry (``kernels``), the collectives
and process groups (``dist``), one rank's model (``model``), the serving engine
(``engine``), the HTTP server (``serve``) and the tools built on them (``tools``).
Each room imports only the rooms listed before it."""
