"""`ModelRouter`: which of an app's servings (one per engine) answers a request, by the request's `model` and the
task its endpoint needs.

Invariants:
- A named model is served by the serving that has that name (a base model or one of its LoRA adapters), else 404.
- A model that cannot do what the endpoint needs is a 400 naming the model's tasks and what the endpoint needs,
  never another model's answer; with no model named, the first serving that can do it answers (for /score and
  /rerank a cross-encoder before an embedding model: it ranks better than a cosine).
- Every model can `tokenize` (/tokenize, /detokenize): it is no task of a model card's."""

from collections.abc import Sequence

from tiffin.plugin.openai.pooling import PoolingServing
from tiffin.plugin.openai.protocol import APIError
from tiffin.plugin.openai.serving import OpenAIServing

Serving = OpenAIServing | PoolingServing
NEEDS = {
    "generate": "a generation model",
    "embed": "an embedding model",
    "score": "an embedding or cross-encoder model",
    "tokenize": "any model",
}


class ModelRouter:
    def __init__(self, servings: Sequence[Serving]) -> None:
        self.servings = list(servings)

    def models(self) -> dict:
        return {"object": "list", "data": [card for s in self.servings for card in s.models()["data"]]}

    def route(self, model: str | None, task: str, endpoint: str) -> Serving:
        """The serving of `model` (None: the first that can do `task`), which must do `task` for `endpoint`."""
        if model is not None:
            serving = next((s for s in self.servings if s.serves(model)), None)
            if serving is None:
                raise APIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")
            if not _can(serving, task):
                message = f"model {model!r} serves {_tasks(serving)}; {endpoint} needs {NEEDS[task]}"
                raise APIError(400, message, param="model")
            return serving
        able = [s for s in self.servings if _can(s, task)]
        if not able:
            served = "; ".join(f"model {s.model_name!r} serves {_tasks(s)}" for s in self.servings)
            raise APIError(400, f"{served}; {endpoint} needs {NEEDS[task]}", param="model")
        return min(able, key=lambda s: task == "score" and "classify" not in s.tasks)  # the first, a ranker first


def _can(serving: Serving, task: str) -> bool:
    return task == "tokenize" or task in serving.tasks


def _tasks(serving: Serving) -> str:
    return ", ".join(serving.tasks)
