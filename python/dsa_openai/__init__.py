"""dsa-openai: an OpenAI-compatible HTTP front (completions, chat completions, models) of
dsa-coordinator's gRPC API. docs/openai.md says how to run it and what it serves."""
from .protocol import ApiError, IncrementalText, Plan, StopMatcher, chat_plan, completion_plan
from .server import FrontOptions, ModelInfo, OpenAiFront

__all__ = ["ApiError", "IncrementalText", "Plan", "StopMatcher", "chat_plan", "completion_plan",
           "FrontOptions", "ModelInfo", "OpenAiFront"]
