"""`pagoda bench` and the measuring tools around it: none of the product's processes imports this package.

- `offline`: the `pagoda bench` command itself (`offline`, and the `serve`, `grammar` and `kernels`
  subcommands' dispatch) and the offline engine against transformers;
- `serve`, `serve_processes`: a running server under load, from one or several client processes;
- `grammar`: structured output's cost per engine step; `soak`: a server at twice its rate for minutes;
- `trace`: where the GPU idles in a torch.profiler trace; `fp8_accuracy`: fp8 schemes against bf16;
- `gpu_check`: the engine on a GPU against transformers, and the random checkpoints every GPU script
  builds (`--build-8b`). Still a script of its own, not yet a pytest suite under `tests/gpu/`.

The stand-in model a benchmark serves (`NullExecutor`) is the one piece that runs inside the engine, so
it lives with the runner (`service/engine/runner/null_executor.py`), chosen by `--executor-class`.
"""
