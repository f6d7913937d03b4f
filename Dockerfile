# triton-gateway: slim, non-root, with a healthcheck.
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md constraints.txt ./
COPY gateway ./gateway
# the versions the suite passed with (constraints.txt), as make test installs them
RUN pip install --no-cache-dir --prefix=/install -c constraints.txt .

FROM python:3.11-slim
RUN useradd --system --uid 10001 --home /var/lib/gateway --create-home gateway
COPY --from=build /install /usr/local
USER gateway
WORKDIR /var/lib/gateway
ENV GATEWAY_HOST=0.0.0.0 \
    GATEWAY_PORT=8080 \
    GATEWAY_GRPC_PORT=8081 \
    GATEWAY_STORE_URL=sqlite:////var/lib/gateway/state.db \
    PYTHONUNBUFFERED=1
EXPOSE 8080 8081
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 \
  CMD python -c "import urllib.request,sys; sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:8080/healthz', timeout=2).status == 200 else 1)"
ENTRYPOINT ["gateway", "serve"]
