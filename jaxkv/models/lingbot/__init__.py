"""lingbot-map (github: Robbyant/lingbot-map) in Flax NNX on jaxkv frame caches.

``LingbotMap`` is the port of upstream's ``GCTStream`` streaming inference;
``LingbotStream`` runs it over a video, one jitted call per frame with the caches
donated; ``load_lingbot_checkpoint`` reads upstream's weights.
"""

from jaxkv.models.lingbot.config import BACKBONES, LingbotConfig
from jaxkv.models.lingbot.model import LingbotMap, aggregator_spec
from jaxkv.models.lingbot.stream import LingbotStream

__all__ = ["BACKBONES", "LingbotConfig", "LingbotMap", "LingbotStream", "aggregator_spec"]
