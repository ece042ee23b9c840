"""The OpenAI-compatible API over `AsyncLLMEngine`s, in these owners, each importing only those listed before it:

- `clients`: which client (API key) sent a request;
- `json_values`: the bound on nesting (and the valid Unicode) of every JSON value a request holds;
- `tools`, `structured`: tool calling and the ways a request constrains its output (also the typed /generate API's
  `structured_outputs` field);
- `answer`: an assistant turn's parts read from a choice's text (reasoning, content, tool calls), whole or streamed;
- `protocol`: request models, their validation into `SamplingParams` or `PoolingParams`, and `APIError`, OpenAI's
  error shape;
- `responses`: the JSON of answers and their streams (`AnswerBuilder`), and the builders of completions and chat;
- `serving`: `OpenAIServing`, which queues requests on the engine and streams, merges and aborts them;
- `messages`: Anthropic's Messages API, translated to and from chat, and Anthropic's error shape;
- `pooling`: `PoolingServing`, embeddings, scores and reranking on an engine whose model embeds or scores pairs;
- `routing`: `ModelRouter`, which serving (one per engine) a request goes to, by its `model` and its endpoint's task;
- `tokenize`: /tokenize and /detokenize on any serving;
- `store`, `responses_request`, `responses_api`: OpenAI's Responses API over the chat path: its store of responses,
  its request and the chat request it translates into, and the endpoints with the Response and its events;
- `batch_store`, `files`, `batches`: OpenAI's Batch API (/files, /batches), durable under `batch_dir`, its lines
  run through `app`'s own routes in-process; `run_batch`: the same, offline (`tiffin batch run`);
- `app`: `create_app`, the FastAPI routes and the mapping of every failure onto OpenAI's error shape
  (Anthropic's for the Messages API).

No BentoML here, and nothing heavy at import: the Bento imports `app` when `bentoml build` loads it."""
