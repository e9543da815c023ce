"""`rollout.true_on_policy` on a real checkpoint, in a process of its own (megatron-core's
parallel state is global, and a trainer of the upcycled MoE holds gigabytes this test process
should not keep): the embedded engine samples ten answers, and megatron-core's old log-probs of
them are compared with the engine's bit for bit.

    python true_on_policy_parity.py MODEL_DIR DTYPE

prints one JSON line: the log-probs that differ, the tokens compared, the largest |difference|,
the distinct log-probs seen and the response tokens.
"""

from __future__ import annotations

import json
import sys

import torch
from test_true_on_policy import TEMPERATURE, _differences, _engine, _rollouts

from ember_core.config import AlgorithmConfig, SamplingConfig
from ember_megatron_backend.config import BackendConfig
from ember_megatron_backend.parallel import init_distributed
from ember_megatron_backend.worker import MegatronWorker


def main(path: str, dtype: str) -> None:
    torch.set_num_threads(2)
    init_distributed()
    config = BackendConfig(hf_load=path, dtype=dtype, micro_batch_size=3)
    sampling = SamplingConfig(temperature=TEMPERATURE, n_samples_per_prompt=2, true_on_policy=True)
    worker = MegatronWorker(config, AlgorithmConfig(), sampling)
    samples = _rollouts(_engine(path, dtype, true_on_policy=True))
    differ, total, largest = _differences(worker, samples)
    result = {
        "differ": differ,
        "total": total,
        "largest": largest,
        "distinct": len({lp for s in samples for lp in s.rollout_log_probs}),
        "response_tokens": sum(s.response_length for s in samples),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
