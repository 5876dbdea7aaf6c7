"""The safety model: its classifier, policies, training data and training, used by the safety processor
and audits.

Config names import eagerly; the classifier (which imports torch) loads on first access.
"""

from safety_model.config import DEFAULT_CATEGORIES, Policy, SafetySettings, safety_settings

__all__ = [
    "DEFAULT_CATEGORIES",
    "Judgement",
    "Policy",
    "SafetyClassifier",
    "SafetySettings",
    "safety_settings",
]


def __getattr__(name: str):
    if name in ("SafetyClassifier", "Judgement"):
        from safety_model import classifier

        return getattr(classifier, name)
    raise AttributeError(f"module 'safety_model' has no attribute {name!r}")
