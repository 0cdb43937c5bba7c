"""The staged upload's batching, on the CPU: page-locking, events and the stream are stand-ins, the
copies and the bookkeeping are real (on the GPU it runs in every resident placement, tests/test_gpu.py)."""

import pytest
import torch

from ddo_blocks.streaming import upload


class _Stream:
    def synchronize(self):
        pass


class _Event:
    def record(self, stream):
        pass

    def synchronize(self):
        pass


@pytest.fixture
def staging(monkeypatch):
    buffers = []

    class Buffer:
        def __init__(self, nbytes, ordinal):
            self.tensor = torch.full((nbytes,), 255, dtype=torch.uint8)
            self.closed = False
            buffers.append(self)

        def close(self):
            self.closed = True

    monkeypatch.setattr(upload, "STAGING_BYTES", 1024)
    monkeypatch.setattr(upload, "PinnedBuffer", Buffer)
    monkeypatch.setattr(upload.torch.cuda, "current_stream", lambda device: _Stream())
    monkeypatch.setattr(upload.torch.cuda, "Event", _Event)
    return buffers


def _nbytes(t):
    return t.numel() * t.element_size()


def test_batches_fill_both_buffers_in_turn_and_hand_back_every_pair(staging):
    torch.manual_seed(0)
    srcs = [torch.randn(n) for n in (10, 200, 64, 3, 250, 1, 7)]  # 4 to 1000 bytes each
    srcs.append(torch.arange(12, dtype=torch.int16).view(3, 4))
    outs = [torch.empty_like(s) for s in srcs]
    batches = []
    upload.staged_upload(list(zip(srcs, outs)), torch.device("cpu"), _nbytes, upload.copy_from_host,
                         queued=batches.append)
    for s, o in zip(srcs, outs):
        assert torch.equal(s, o)
    assert [p for b in batches for p in b] == list(zip(srcs, outs))
    assert len(batches) >= 3  # 1024-byte buffers: the pairs do not fit one or two batches
    assert len(staging) == 2 and all(b.closed for b in staging)


def test_one_batch_page_locks_one_buffer(staging):
    src = torch.randn(16)
    out = torch.empty_like(src)
    upload.staged_upload([(src, out)], torch.device("cpu"), _nbytes, upload.copy_from_host)
    assert torch.equal(src, out)
    assert len(staging) == 1 and staging[0].closed


def test_a_source_larger_than_a_buffer_is_refused_and_nothing_stays_locked(staging):
    small, big = torch.randn(4), torch.randn(1000)
    with pytest.raises(ValueError, match="does not fit"):
        upload.staged_upload([(small, torch.empty_like(small)), (big, torch.empty_like(big))], torch.device("cpu"),
                             _nbytes, upload.copy_from_host)
    assert all(b.closed for b in staging)
