"""How a sink's steps run: the executor, its strategies and compiled programs."""
