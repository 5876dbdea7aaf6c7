"""Conversation manager: history per conversation, assistant presets, context-window trimming."""
