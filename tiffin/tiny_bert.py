"""Deterministic tiny BERT checkpoints built without any download, for the tests of pooling models: an embedding
model (`BertModel`, as a sentence-transformers directory: modules.json, 1_Pooling, Normalize) and a cross-encoder
(`BertForSequenceClassification`). Weights are random, every LayerNorm and bias included (Hugging Face would start
them at constants, which hides wiring mistakes); the WordPiece tokenizer (lower-cased, [CLS] a [SEP] b [SEP] with
token types) is trained on the Python stdlib's own text (`tiffin.tiny.stdlib_corpus`).
"""

import json
import pathlib

import torch

from tiffin.tiny import stdlib_corpus

SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
CLS_ID, SEP_ID = 2, 3
_POOLING_FLAGS = {"mean": "pooling_mode_mean_tokens", "cls": "pooling_mode_cls_token", "last": "pooling_mode_lasttoken"}
_CONFIG = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    vocab_size=1024,
    max_position_embeddings=256,
    type_vocab_size=2,
    hidden_act="gelu",
    layer_norm_eps=1e-12,
    initializer_range=0.1,  # spread enough that different inputs score clearly differently
    pad_token_id=0,
)


def train_wordpiece(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False)
    tok.train_from_iterator(stdlib_corpus(vocab_size * 256), trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A:0 [SEP]:0 $B:1 [SEP]:1",
        special_tokens=[("[CLS]", CLS_ID), ("[SEP]", SEP_ID)],
    )
    return tok


def make_tiny_bert(
    path: str | pathlib.Path,
    cross_encoder: bool = False,
    seed: int = 0,
    pooling: str = "mean",
    normalize: bool = True,
    **config_overrides,
) -> pathlib.Path:
    """Write a tiny BERT to `path`: an embedding model as a sentence-transformers directory (`pooling`: mean, cls or
    last; `normalize`: a Normalize module), or with `cross_encoder` a one-label BertForSequenceClassification."""
    from transformers import BertConfig, BertForSequenceClassification, BertModel, BertTokenizerFast

    path = pathlib.Path(path)
    config = BertConfig(**{**_CONFIG, **config_overrides}, num_labels=1)
    torch.manual_seed(seed)
    model = (BertForSequenceClassification if cross_encoder else BertModel)(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "LayerNorm" in name or name.endswith("bias"):
                param.copy_(torch.randn_like(param) * 0.2 + (1.0 if name.endswith("weight") else 0.0))
            elif name.startswith("classifier"):  # scores spread over the sigmoid's slope, not piled at one value
                param.copy_(torch.randn_like(param) / param.shape[-1] ** 0.5)
    model.save_pretrained(path)
    tokenizer = BertTokenizerFast(tokenizer_object=train_wordpiece(config.vocab_size), do_lower_case=True)
    tokenizer.add_special_tokens(
        dict(zip(("pad_token", "unk_token", "cls_token", "sep_token", "mask_token"), SPECIAL_TOKENS))
    )
    tokenizer.model_max_length = config.max_position_embeddings
    tokenizer.save_pretrained(path)
    if not cross_encoder:
        _sentence_transformers_files(path, config.hidden_size, pooling, normalize)
    return path


def _sentence_transformers_files(path: pathlib.Path, size: int, pooling: str, normalize: bool) -> None:
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (path / "modules.json").write_text(json.dumps(modules, indent=2))
    (path / "1_Pooling").mkdir(exist_ok=True)
    modes = {flag: kind == pooling for kind, flag in _POOLING_FLAGS.items()}
    (path / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": size, **modes}, indent=2))
    (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 128, "do_lower_case": False}))
