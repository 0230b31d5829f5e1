"""The character tokenizer: fits the model's vocab, round-trips, loads with AutoTokenizer."""

import transformers

from pdflow.bench.tasks import vocab as V


def test_vocab_fits_tiny_geometry():
    v = V.vocab()
    assert len(v) == V.VOCAB_SIZE == 128
    assert (v[V.PAD], v[V.BOS], v[V.EOS], v[V.UNK]) == (V.PAD_ID, V.BOS_ID, V.EOS_ID, V.UNK_ID)
    assert v["\n"] == V.NEWLINE_ID


def test_autotokenizer_matches_fast_encoder(tmp_path):
    V.save_tokenizer(tmp_path)
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    text = "Question: Mira has 12 + 7 = 19 apples.\nAnswer: #### 19\n\n $5, ok?"
    ids = tok(text)["input_ids"]
    assert ids == [V.BOS_ID, *V.encode(text)]
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert V.decode(ids) == text
    assert tok("é", add_special_tokens=False)["input_ids"] == [V.UNK_ID]
    assert (tok.pad_token_id, tok.eos_token_id, tok.padding_side) == (V.PAD_ID, V.EOS_ID, "left")
