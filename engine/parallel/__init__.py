"""The parallel dimensions: the rank grid and the ParallelContext passed to everything, every collective,
tensor-parallel communication as autograd pairs, the tensor-parallel layers, vocabulary-parallel
cross-entropy, dropout streams and recomputation. One module per piece; import them directly."""
