"""The engine's torch side: the executor (one rank in-process, or tensor-parallel worker processes),
the model runner (batches, CUDA graphs, block tables), the sampler. Built in the core process by
`build_executor`; nothing here runs in the API process."""
