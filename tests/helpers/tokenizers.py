"""Small tokenizers built with the tokenizers library: a byte-level BPE with Llama-3/ChatML specials and its ChatML template."""

from __future__ import annotations

from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

SPECIALS = ["<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>", "<|im_start|>", "<|im_end|>"]


MERGES = [("Ġ", "w"), ("Ġw", "o"), ("h", "i"), ("Ġ", "t"), ("Ġt", "h"), ("Ġth", "e")]


CHATML = """{% for message in messages %}
<|im_start|>{{ message['role'] }}
{{ message['content'] }}<|im_end|>
{% endfor %}
    {% if add_generation_prompt %}
<|im_start|>assistant
    {% endif %}"""  # relies on trim_blocks (newline after a tag) and lstrip_blocks (indent before one)


def byte_symbols() -> list[str]:
    """GPT-2's printable stand-in for each byte value (index = byte)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    symbols, extra = [], 0
    for b in range(256):
        symbols.append(chr(b) if b in printable else chr(256 + extra))
        extra += b not in printable
    return symbols


def byte_level_json(bos_post_processor: bool = False) -> str:
    """A GPT-2 style byte-level BPE tokenizer.json: 256 byte symbols, a few merges, Llama-3/ChatML specials."""
    vocab = {s: i for i, s in enumerate(byte_symbols() + [a + b for a, b in MERGES] + SPECIALS)}
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=MERGES))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    if bos_post_processor:
        hf.post_processor = processors.TemplateProcessing(
            single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", vocab["<|begin_of_text|>"])]
        )
    return hf.to_str()

