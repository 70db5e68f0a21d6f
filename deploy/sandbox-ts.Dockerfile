# The TypeScript sandbox image (studio-code-ts:1) for the `images` profile of
# deploy/compose.yaml; the same image as docker/studio-code-ts/Dockerfile, but the deno
# binary comes from the PyPI package `deno` in a first stage (docker/build.sh copies the
# host's instead). Context: docker/studio-code-ts (for deps.ts).
ARG DENO_VERSION=2.9.8
FROM python:3.12-slim AS deno
ARG DENO_VERSION
RUN pip install --no-cache-dir "deno==${DENO_VERSION}"

FROM debian:trixie-slim
ENV DENO_DIR=/deno-dir \
    DENO_NO_UPDATE_CHECK=1 \
    NO_COLOR=1 \
    DENO_EMIT_CACHE_MODE=disable \
    PATH=/usr/local/bin:/usr/bin:/bin
COPY --from=deno /usr/local/bin/deno /usr/local/bin/deno
COPY deps.ts /opt/studio-code/
RUN deno cache --no-config --no-lock /opt/studio-code/deps.ts \
 && rm -rf /deno-dir/gen /deno-dir/*_cache_v2* /deno-dir/latest.txt \
 && chmod -R a+rX /deno-dir /opt/studio-code
LABEL studio.image=typescript
WORKDIR /tmp
USER 65534:65534
