"""The OpenAI-compatible API over `AsyncLLMEngine`s, in these owners, each importing only those listed before it:

- `tools`, `structured`: tool calling and the ways a request constrains its output (also the typed /generate API's
  `structured_outputs` field);
- `protocol`: request models, their validation into `SamplingParams` or `PoolingParams`, and `APIError`, OpenAI's
  error shape;
- `responses`: the JSON of responses and stream chunks, one builder class per endpoint;
- `serving`: `OpenAIServing`, which queues requests on the engine and streams, merges and aborts them;
- `messages`: Anthropic's Messages API, translated to and from chat, and Anthropic's error shape;
- `pooling`: `PoolingServing`, embeddings, scores and reranking on an engine whose model embeds or scores pairs;
- `routing`: `ModelRouter`, which serving (one per engine) a request goes to, by its `model` and its endpoint's task;
- `app`: `create_app`, the FastAPI routes and the mapping of every failure onto OpenAI's error shape
  (Anthropic's for the Messages API).

No BentoML here, and nothing heavy at import: the Bento imports `app` when `bentoml build` loads it."""
