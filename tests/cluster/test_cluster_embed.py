"""Embeddings past one host, against a real nats-server and a real broker node (`shmbroker
supervise`, the simulated engine with `task = "embed"`): a RemoteProducer's embedding items come
back as their prompts' vectors, bit-exact, through JetStream's results subjects; a generation item
sent to that node fails alone, naming why."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
from support.natsproc import start_or_skip

pytest.importorskip("nats", reason="nats-py is not installed (pip install 'shmbroker[cluster]')")

from shmbroker.bench.cluster_nodes import LocalNode, wait_partitions  # noqa: E402
from shmbroker.cluster.remote import RemoteProducer  # noqa: E402
from shmbroker.cluster.subjects import ClusterNames, StreamSettings  # noqa: E402
from shmbroker.engines.options import SimSettings  # noqa: E402
from shmbroker.engines.sim_embed import SimEmbedder  # noqa: E402
from shmbroker.request.options import EMBED, Task  # noqa: E402

pytestmark = pytest.mark.timeout(240)

DIMS = 768
SETTINGS = StreamSettings(prompts_max_bytes=64 << 20, results_max_bytes=64 << 20)
CONSUMER = f"""
[[consumers]]
name = "enc"
max_batch_size = 32
max_batch_tokens = 16384
max_input_len = 1024
engine_settings = {{ mode = "padded", task = "embed", embed_dimensions = {DIMS}, pace_seconds = 0.0 }}
"""


@dataclass
class EmbeddingNode(LocalNode):
    """A broker node whose one simulated consumer embeds."""

    def config_text(self) -> str:
        return super().config_text().split("\n[[consumers]]", 1)[0] + "\n" + CONSUMER


def test_a_remote_producers_embeddings_come_back_bit_exact(tmp_path):
    server = start_or_skip(1)
    node = EmbeddingNode("embed", str(tmp_path), server.urls)
    node.start()
    try:
        wait_partitions([node], ClusterNames().num_partitions, 90)
        rng = np.random.default_rng(4)
        lengths = rng.integers(1, 600, 200)
        flat = rng.integers(1, 30000, int(lengths.sum()), dtype=np.uint32)
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        with RemoteProducer("embedder", servers=server.urls, settings=SETTINGS) as p:
            ids = p.submit_many(flat, offsets, max_new_tokens=0, options=EMBED)
            wrong = p.submit(flat[:20], max_new_tokens=4)
            got = {}
            while len(got) < ids.size + 1:
                for r in p.results(2.0):
                    got[int(r.item_id)] = r
        model = SimEmbedder(SimSettings(task=Task.EMBED, embed_dimensions=DIMS))
        for k, i in enumerate(ids.tolist()):
            r = got[i]
            assert r.status == "ok", r.error
            want = model.vector(flat[offsets[k] : offsets[k + 1]])
            assert np.array_equal(r.vector.view(np.uint32), want.view(np.uint32))
        assert got[int(wrong)].status == "invalid" and "embeds" in got[int(wrong)].error
    finally:
        node.stop()
        server.stop()
