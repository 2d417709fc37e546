# `copc env serve` in a container: a COPC environment served with the OpenEnv protocol.
#
# NOT BUILT OR RUN IN THIS PROJECT'S CI: the development machines have no Docker daemon. The
# commands below are the intended use; see docs/remote_envs.md ("Docker") for what is and is not
# verified.
#
# Build (from the repository root):
#   docker build -f docker/env-server.Dockerfile -t copc-env-server .
# Run math_tool, published on the host's loopback only, with a bearer token (required: inside the
# container the server binds 0.0.0.0 so that the published port reaches it):
#   head -c 32 /dev/urandom | base64 > env-token
#   docker run --rm -p 127.0.0.1:8100:8100 -v "$PWD/env-token:/run/secrets/copc_env_token:ro" \
#       --cap-add SYS_ADMIN --security-opt seccomp=unconfined --security-opt apparmor=unconfined \
#       copc-env-server --env math_tool
# The bwrap sandbox creates namespaces, which Docker's default seccomp / AppArmor profiles and
# dropped capabilities forbid: without the three options above the sandbox's start-up self-check
# fails and the server exits (it never runs code with weaker isolation silently). Environments
# without a sandbox (search) need none of them:
#   docker run --rm -p 127.0.0.1:8100:8100 -v "$PWD/env-token:/run/secrets/copc_env_token:ro" \
#       copc-env-server --env search retriever_url=http://host.docker.internal:8000
FROM python:3.11-slim

RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends bubblewrap \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/copc
COPY pyproject.toml README.md ./
COPY constraints ./constraints
COPY seams ./seams
COPY copc ./copc
COPY environments ./environments
COPY retriever ./retriever
COPY trainer ./trainer
# torch is a core dependency of the package (the server never imports it); the CPU wheel keeps
# the image small. envs: gymnasium + math-verify; openenv: the protocol types, FastAPI, uvicorn,
# websockets (pinned version).
RUN pip install --no-cache-dir --index-url https://download.pytorch.org/whl/cpu \
        "$(grep '^torch==' constraints/cpu.txt)" \
    && pip install --no-cache-dir -c constraints/cpu.txt ".[envs,openenv]" httpx pyyaml

# The sandbox runs code as uid 61000+ inside its own namespaces; the server itself runs as root
# in the container because bwrap needs it there (see above).
EXPOSE 8100
HEALTHCHECK --interval=30s --timeout=5s --start-period=30s \
    CMD python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8100/health', timeout=4)"
ENTRYPOINT ["copc", "env", "serve", "--host", "0.0.0.0", "--port", "8100", \
            "--token-file", "/run/secrets/copc_env_token"]
CMD ["--env", "math_tool"]
