"""What tiffin's tests and benchmarks share; the engine and the Bento never import it."""
