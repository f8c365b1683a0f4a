"""The wire benchmark's policy with the peers' payload: 2 cameras 224x224 and a 26-d state in, (30, 26) out, 0 ms.

The payload of issue 37's side-by-side runs; the answer is a zero float32 chunk.

The cameras are declared ``raw``; a robot may send them as JPEG bytes too (an encoded frame passes through the
client untouched and the worker decodes it), which the benchmark's JPEG rows do.
"""

import numpy as np

import sequence_ai_ros.policy as seq

JOINTS = [f'j{i}' for i in range(26)]


@seq.policy(action_space='joint_absolute', action_names=JOINTS, dt=0.02, chunk_length=30,
            observation=seq.ObservationContract(cameras=[seq.CameraSpec('cam_a', 224, 224, 'raw'),
                                                         seq.CameraSpec('cam_b', 224, 224, 'raw')],
                                                state_names=JOINTS))
class Wire30:
    """Answer at once."""

    def infer(self, inp: seq.PolicyInput, episode: seq.Episode) -> np.ndarray:
        return np.zeros((30, 26), np.float32)
