"""A tiny random Llama with a locally trained tokenizer, for tests.

`build_tiny_llama` makes, in a second or two and without any download, a checkpoint folder that
transformers and vLLM (CPU) both load: a 2-layer `LlamaForCausalLM` (hidden size 64, 2 query
heads and 1 key/value head of size 32, the smallest head size vLLM's CPU attention supports)
with random weights, and a byte-level BPE tokenizer trained on a small embedded corpus, with
ChatML special tokens and chat template (the same shape as SmolLM2's). The same seed gives
byte-identical files.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)

from noisy_temp_server.checkpoints.checkpoint import save_checkpoint

__all__ = ["TINY_VOCAB_SIZE", "build_tiny_llama", "build_tiny_tokenizer"]

TINY_VOCAB_SIZE = 512
TINY_MAX_POSITIONS = 2048
# Larger than transformers' default 0.02, so the random model's logits have a spread
# (std of a few units) like a trained model's rather than being almost uniform.
_INIT_STD = 0.25

_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_CORPUS = """\
The capital of France is Paris. The capital of Italy is Rome. The capital of Spain is Madrid.
The quick brown fox jumps over the lazy dog. A noisy model is served at a temperature that
brings it closest to the clean model. Temperature scaling divides the logits by a number.
When the number is larger than one, the distribution becomes flatter; when it is smaller,
the distribution becomes sharper. The oracle temperature minimises the divergence between
the clean distribution and the served one, one position at a time.
Once upon a time there was a little robot who liked to count: one, two, three, four, five,
six, seven, eight, nine, ten. It counted the stars in the sky and the waves in the sea.
Question: What is two plus two? Answer: Two plus two is four.
Question: What colour is the sky? Answer: The sky is blue on a clear day.
def add(a, b):
    return a + b
for i in range(10):
    print(i * i)
Hello! How can I help you today? I am a helpful assistant. Thank you, goodbye.
"""


def build_tiny_tokenizer() -> PreTrainedTokenizerBase:
    """A byte-level BPE tokenizer of at most `TINY_VOCAB_SIZE` tokens, trained on the corpus.

    Token ids 0, 1, 2 are `<|endoftext|>`, `<|im_start|>`, `<|im_end|>`; bos is
    `<|im_start|>`, eos and pad are `<|im_end|>` (as in SmolLM2-Instruct). Deterministic.
    """
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB_SIZE,
        special_tokens=list(_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(_CORPUS.splitlines(keepends=True), trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|im_end|>",
        unk_token="<|endoftext|>",
        model_max_length=TINY_MAX_POSITIONS,
    )
    tokenizer.chat_template = _CHAT_TEMPLATE
    return tokenizer


def build_tiny_llama(dest: Path, seed: int = 0, *, replace: bool = False) -> Path:
    """Build the tiny random Llama checkpoint at `dest` (see the module docstring); return it.

    Weights are float32, drawn from a generator seeded with `seed` (the global torch RNG is
    left untouched). FileExistsError if `dest` exists and `replace` is False.
    """
    tokenizer = build_tiny_tokenizer()
    config = LlamaConfig(
        vocab_size=TINY_VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=TINY_MAX_POSITIONS,
        rms_norm_eps=1e-5,
        initializer_range=_INIT_STD,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )
    with torch.random.fork_rng(devices=[]):  # the constructor's own init draws globally
        model = LlamaForCausalLM(config).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                parameter.fill_(1.0)
            else:
                parameter.normal_(0.0, _INIT_STD, generator=generator)
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    )
    save_checkpoint(
        Path(dest),
        model,
        tokenizer,
        kind="tiny-model",
        description="tiny random Llama with a locally trained byte-level BPE tokenizer (tests)",
        source=f"tiny_model.build_tiny_llama(seed={seed})",
        metadata={"seed": seed, "init_std": _INIT_STD},
        replace=replace,
    )
    return Path(dest)
