"""Runtime primitives (comm layer, kernel launch helpers) and, later, the engine."""
