"""Looking inside a ViT: the paper's figures 6, 7 and 11 (embeddings, attention distance, rollout)."""

from vitkit.analysis.analyze import AnalyzeOptions, analyze, attention_analysis
from vitkit.analysis.attention_maps import (
    attention_maps,
    attention_rollout,
    distance_matrix,
    mean_attention_distance,
    rollout_maps,
)
from vitkit.analysis.embeddings import (
    patch_embedding_pca,
    position_embeddings,
    position_similarity,
)

__all__ = [
    "AnalyzeOptions",
    "analyze",
    "attention_analysis",
    "attention_maps",
    "attention_rollout",
    "distance_matrix",
    "mean_attention_distance",
    "patch_embedding_pca",
    "position_embeddings",
    "position_similarity",
    "rollout_maps",
]
