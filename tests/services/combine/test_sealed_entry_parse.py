"""The combine's one check per byte of an entry that arrived (services.combine.fetch._open_and_parse):
the seal's tag (a MAC over every byte), then a parse whose tensors view the received buffer. A real entry of a tiny
model; every damaged byte, in header, tensors, digest or tag, is still refused."""
import random

import pytest
import torch

from common.engine.hybrid_engine import HybridEngine
from common.engine.fingerprint import segment_key
from common.engine.pic.entry import AttentionBody, EntryError, LinearBody, SegmentEntry
from common.engine.pic.seal import V1_MAGIC, _v1_tag, open_sealed, seal
from services.combine.fetch import BadEntry, _open_and_parse
from tests.support.tiny import PIC_CONFIGS, save_tiny

SECRET = b"k" * 32


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = save_tiny("qwen3_5_text", tmp_path_factory.mktemp("q"), seed=5, **PIC_CONFIGS["qwen3_5_text"])
    return HybridEngine.from_pretrained(path)


def tensors(entry: SegmentEntry) -> list[torch.Tensor]:
    out = []
    for b in entry.layers:
        if isinstance(b, LinearBody):
            out += [b.T, b.S] + [t for t in (b.conv_tail, b.warmup_inputs) if t is not None]
        elif isinstance(b, AttentionBody):
            out += [b.keys, b.values]
    return out


def sealed_entry(engine, fresh_seed: int):
    g = torch.Generator().manual_seed(fresh_seed)
    ids = torch.randint(0, engine.vocab_size, (37,), generator=g).tolist()
    entry = engine.build_entry(ids, 8)
    key = segment_key(engine.fingerprint, 8, "float32", ids)
    return entry, key, seal(entry.to_bytes(), SECRET)


def test_a_sealed_entry_parses_into_views_of_the_received_buffer(engine, fresh_seed):
    entry, key, sealed = sealed_entry(engine, fresh_seed)
    buf = bytearray(sealed)  # what a read hands over: a fresh writable buffer
    got = _open_and_parse(buf, key, SECRET)
    assert got.token_ids == entry.token_ids
    lo, hi = torch.frombuffer(buf, dtype=torch.uint8).data_ptr(), None
    hi = lo + len(buf)
    for a, b in zip(tensors(got), tensors(entry)):
        assert torch.equal(a, b)
        assert lo <= a.data_ptr() < hi  # a view, not a copy


def test_every_damaged_byte_of_a_sealed_entry_is_refused(engine, fresh_seed):
    rng = random.Random(fresh_seed)
    entry, key, sealed = sealed_entry(engine, fresh_seed)
    for i in sorted(rng.sample(range(len(sealed)), 60)) + [len(sealed) - 1, 0]:
        bad = bytearray(sealed)
        bad[i] ^= 1 << rng.randrange(8)
        with pytest.raises(BadEntry) as e:
            _open_and_parse(bad, key, SECRET)
        assert e.value.reason == "forged", i
    with pytest.raises(BadEntry):
        _open_and_parse(bytearray(sealed), key, b"another mesh's key")


def test_unsealed_bytes_keep_their_digest_check(engine, fresh_seed):
    """Without a seal opened first (sealed=False, the default) the digest is still the check."""
    entry, _, _ = sealed_entry(engine, fresh_seed)
    data = bytearray(entry.to_bytes())
    data[len(data) // 2] ^= 0x10
    with pytest.raises(EntryError):
        SegmentEntry.from_bytes(data)


def test_seals_are_fresh_and_entries_sealed_before_still_open(engine, fresh_seed):
    """Every seal draws its own nonce (so its own one-time key): two seals of one entry differ and
    both open. An entry sealed with the earlier HMAC-SHA256 tag opens too, and refuses damage."""
    rng = random.Random(fresh_seed)
    entry, key, sealed = sealed_entry(engine, fresh_seed)
    data = entry.to_bytes()
    again = seal(data, SECRET)
    assert again != sealed and bytes(open_sealed(again, key, SECRET)) == data == bytes(open_sealed(sealed, key, SECRET))
    assert again[-16:] != sealed[-16:]  # another one-time key: another tag for the same bytes
    v1 = data + V1_MAGIC + _v1_tag(data, SECRET)
    assert _open_and_parse(bytearray(v1), key, SECRET).token_ids == entry.token_ids
    for i in rng.sample(range(len(v1)), 20):
        bad = bytearray(v1)
        bad[i] ^= 1 << rng.randrange(8)
        with pytest.raises(BadEntry):
            _open_and_parse(bad, key, SECRET)
    # a v2 tag moved onto other bytes (the header's tokens changed) does not open
    other = bytearray(sealed)
    other[sealed.index(b"token_ids") + 12] ^= 1
    with pytest.raises(BadEntry):
        _open_and_parse(other, key, SECRET)
