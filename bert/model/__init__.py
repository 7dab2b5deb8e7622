"""Unpadded BERT for MLPerf pre-training: config, model, attention backends, checkpoints."""

from bert.model.config import BertConfig
from bert.model.pretraining import BertForPreTraining, PretrainOutput

__all__ = ["BertConfig", "BertForPreTraining", "PretrainOutput"]
