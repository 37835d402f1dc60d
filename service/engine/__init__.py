"""The engine: requests, KV block manager, scheduler, model runner, sampler, step loop."""
