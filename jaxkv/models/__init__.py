"""Example models built on jaxkv (random weights, no downloads) and their synthetic inputs."""

from jaxkv.models.reconstructor import LINGBOT_518, SMALL, ReconstructorConfig, StreamingReconstructor
from jaxkv.models.synthetic import SyntheticVideo, synthetic_video

__all__ = ["LINGBOT_518", "SMALL", "ReconstructorConfig", "StreamingReconstructor", "SyntheticVideo",
           "synthetic_video"]
