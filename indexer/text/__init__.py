"""Text prompts and chat messages to token ids, as vLLM tokenizes them: a surface
helper beside the facades (needs the ``text`` extra, imported lazily).

``tokenizer`` reads Hugging Face tokenizer directories and encodes prompts; ``chat``
renders chat templates as vLLM does.
"""

from indexer.text.tokenizer import (
    ChatError,
    TextError,
    Tokenized,
    Tokenizer,
    TokenizerLoadError,
    load_tokenizers,
    match_text,
    route_text,
)

__all__ = ["ChatError", "TextError", "TokenizerLoadError", "Tokenized", "Tokenizer", "load_tokenizers",
           "match_text", "route_text"]
