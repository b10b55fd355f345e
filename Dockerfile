# The proxy's image: `docker run IMAGE --prefill URL --decode URL` serves.
#
#   make image                        # docker or podman, whichever is here
#   docker build --build-arg BASE=python:3.12-slim -t nixl-twisted .
#
# Three stages. The first builds every wheel: the proxy's from this tree and
# its dependencies', from PyPI, or, when the context holds a wheelhouse/ made
# beforehand (`make image` makes one), from it alone, with no network. The
# second installs those wheels with no index at all, into a virtualenv; the
# image is the base, that virtualenv and an unprivileged user. Any glibc base
# with python3 and its venv module does: deploy/image/debian-base.sh makes one
# from Debian's archive where no registry can be reached.
ARG BASE=python:3.12-slim

FROM ${BASE} AS wheels
COPY . /src
RUN set -eu; \
    python3 -m venv /build; \
    if [ -d /src/wheelhouse ]; then \
        from="--no-index --find-links /src/wheelhouse"; \
    else \
        from=""; \
    fi; \
    /build/bin/python -m pip wheel --no-cache-dir --quiet $from --wheel-dir /wheels /src

# The second stage installs the wheels with no index at all, into a
# virtualenv; the last one takes the virtualenv alone, so that no wheel stays
# in a layer (a RUN --mount would need BuildKit). The plugin cache is written
# here, as root: the root filesystem is read-only at run time, and twistd
# would otherwise try to write it on each start.
FROM ${BASE} AS venv
COPY --from=wheels /wheels /wheels
RUN set -eu; \
    python3 -m venv /opt/nixlproxy; \
    /opt/nixlproxy/bin/python -m pip install --no-cache-dir --quiet --no-index \
        --find-links /wheels nixl-twisted; \
    /opt/nixlproxy/bin/python -m pip uninstall --quiet --yes pip setuptools; \
    /opt/nixlproxy/bin/python -c \
        "from twisted.plugin import IPlugin, getPlugins; list(getPlugins(IPlugin))"

FROM ${BASE}
ARG BASE
ARG VERSION=0
ARG REVISION=unknown
LABEL org.opencontainers.image.title="nixl-twisted" \
      org.opencontainers.image.description="A Twisted proxy for vLLM disaggregated prefill/decode serving over NIXL" \
      org.opencontainers.image.licenses="MIT" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.base.name="${BASE}"
COPY --from=venv /opt/nixlproxy /opt/nixlproxy
RUN useradd --uid 10001 --user-group --no-create-home --home-dir /nonexistent \
        --shell /usr/sbin/nologin nixlproxy
ENV PATH=/opt/nixlproxy/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
USER 10001:10001
EXPOSE 8000 9000 9100
# SIGTERM drains (docs/operations.md): the proxy stops accepting, lets the
# requests in flight finish within --drain-timeout and exits 0. Give it that
# long: `docker stop -t 45`, `docker run --stop-timeout 45`, or Kubernetes'
# terminationGracePeriodSeconds (the chart works it out from the same values).
STOPSIGNAL SIGTERM
ENTRYPOINT ["twistd", "--nodaemon", "--pidfile=", "nixlproxy"]
CMD ["--help"]
