"""One small generator per kernel family. Each turns the plan into ``KernelFile``s:
which template, with which validated values."""
