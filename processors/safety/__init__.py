"""Safety classifier for the safety stream processor.

Config names import eagerly; the classifier (which imports torch) loads on first access.
"""

from processors.safety.config import DEFAULT_CATEGORIES, Policy, SafetySettings, safety_settings

__all__ = ["DEFAULT_CATEGORIES", "Judgement", "Policy", "SafetyClassifier", "SafetySettings",
           "safety_settings"]


def __getattr__(name: str):
    if name in ("SafetyClassifier", "Judgement"):
        from processors.safety import classifier

        return getattr(classifier, name)
    raise AttributeError(f"module 'processors.safety' has no attribute {name!r}")
