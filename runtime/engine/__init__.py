"""Engine and scheduling: the public LLM API, the engine step loop, scheduler, paged KV blocks, requests, sampling."""
