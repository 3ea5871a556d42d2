"""The tiny pair's tokenizer: byte-level BPE with <s> </s> <pad> and a plain-text chat template,
trained and saved as a transformers fast tokenizer that transformers 4.x and 5.x both read."""

from __future__ import annotations

import json
from pathlib import Path

VOCAB_SIZE = 8192
BOS, EOS, PAD = "<s>", "</s>", "<pad>"
# Plain-text role markers: no extra special tokens, so any client can type them.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def train_tokenizer(train_texts: list[str], out_dir: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, min_frequency=2, show_progress=True,
                                  special_tokens=[BOS, EOS, PAD],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(train_texts, trainer=trainer, length=len(train_texts))
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)])
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS,
                                     pad_token=PAD, clean_up_tokenization_spaces=False,
                                     model_max_length=2048)
    hf_tok.chat_template = CHAT_TEMPLATE
    save_tokenizer(hf_tok, out_dir)
    return hf_tok


def save_tokenizer(tokenizer, out_dir: Path) -> None:
    """Save with the chat template inside tokenizer_config.json and a class name that transformers
    4.x and 5.x both resolve, so older readers get the template and the fast tokenizer too."""
    tokenizer.save_pretrained(out_dir, save_jinja_files=False)
    config_path = out_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    for key in ("is_local", "local_files_only"):  # how it was loaded, not what it is
        config.pop(key, None)
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
