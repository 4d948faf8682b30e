"""Models built on jaxkv: lingbot-map's shape (``StreamingReconstructor``, random weights, with a
synthetic video), DeepSeek-V4's attention block (``deepseek_v4.V4Attention``) and the lingbot-map
port (``jaxkv.models.lingbot``)."""

from jaxkv.models.deepseek_v4 import V4Attention, V4AttentionConfig
from jaxkv.models.reconstructor import LINGBOT_518, SMALL, ReconstructorConfig, StreamingReconstructor
from jaxkv.models.synthetic import SyntheticVideo, synthetic_video

__all__ = [
    "LINGBOT_518",
    "SMALL",
    "ReconstructorConfig",
    "StreamingReconstructor",
    "SyntheticVideo",
    "V4Attention",
    "V4AttentionConfig",
    "synthetic_video",
]
