"""dsa_model: the real model of docs/model.md (SmolLM2-135M with a lightning indexer) on the host:
the GGUF converter (`convert`), the tokenizer (`tokenizer`), the training/evaluation text
(`corpus`) and the numpy reference forward (`reference`). Shapes and names are in `config`."""
from .config import IndexerConfig, ModelConfig, ModelFileError

__all__ = ["IndexerConfig", "ModelConfig", "ModelFileError"]
