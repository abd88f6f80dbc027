"""Real servers for archives in object storage, started and stopped by the tests (and by
scripts/bench-remote.py): s3s-fs, an S3 server over a directory that checks SigV4
signatures, and nginx serving files with HTTP range requests. scripts/setup.sh installs
both."""
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

ACCESS_KEY = "cawsfs-test-access"
SECRET_KEY = "cawsfs-test-secret-never-shown"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_port(host, port, proc, what, limit=30):
    deadline = time.time() + limit
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited ({proc.returncode})")
        try:
            socket.create_connection((host, port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{what} did not listen on {port} within {limit} s")


def _exe(name):
    p = shutil.which(name) or str(Path.home() / ".cargo" / "bin" / name)
    assert os.access(p, os.X_OK), f"{name} is not installed (scripts/setup.sh installs it)"
    return p


class S3Server:
    """s3s-fs over `root`: the object s3://BUCKET/KEY is the file root/BUCKET/KEY.
    `wrap` prefixes the command (e.g. `ip netns exec NS`), `host` is where it listens."""

    def __init__(self, root, port=None, host="127.0.0.1", wrap=()):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.host, self.wrap = host, list(wrap)
        self.proc = None
        self.start()

    def start(self):
        self.proc = subprocess.Popen(
            [*self.wrap, _exe("s3s-fs"), "--host", self.host, "--port", str(self.port),
             "--access-key", ACCESS_KEY, "--secret-key", SECRET_KEY, str(self.root)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _wait_port(self.host, self.port, self.proc, "s3s-fs")

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    @property
    def endpoint(self):
        return f"http://{self.host}:{self.port}"

    def env(self, **extra):
        """The environment a client of this server gets (the standard variables)."""
        e = dict(os.environ)
        for k in list(e):
            if k.startswith("AWS_"):
                del e[k]
        e.update(AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY,
                 AWS_REGION="us-east-1", AWS_ENDPOINT_URL=self.endpoint)
        e.update(extra)
        return e

    def put(self, bucket, key, src):
        """Upload `src` with a signed PUT (curl's SigV4), as a client would: s3s-fs then
        keeps the object's ETag, where a file copied into its directory would be hashed
        whole for every GET (~0.15 s per request for the test archive)."""
        (self.root / bucket).mkdir(parents=True, exist_ok=True)
        subprocess.run(
            ["curl", "-sS", "--fail", "-T", str(src), "--aws-sigv4", "aws:amz:us-east-1:s3",
             "--user", f"{ACCESS_KEY}:{SECRET_KEY}", "-H", "x-amz-content-sha256: UNSIGNED-PAYLOAD",
             f"{self.endpoint}/{bucket}/{key}"], check=True, capture_output=True)
        return f"s3://{bucket}/{key}"

    def put_tree(self, bucket, prefix, src):
        """Upload every file under the directory `src` as `prefix/RELATIVE/PATH` (eight
        uploads at a time); returns the prefix's URL, ending in `/`."""
        from concurrent.futures import ThreadPoolExecutor
        src = Path(src)
        files = [p for p in src.rglob("*") if p.is_file()]
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda p: self.put(bucket, f"{prefix}/{p.relative_to(src)}", p), files))
        return f"s3://{bucket}/{prefix}/"


class HttpServer:
    """nginx serving `root` (with Range, ETag and Last-Modified, as it does for files);
    `host` and `wrap` as for S3Server."""

    def __init__(self, root, port=None, host="127.0.0.1", wrap=()):
        self.host = host
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.dir = self.root.parent / f"nginx-{self.port}"
        self.dir.mkdir(exist_ok=True)
        user = "user root;" if os.geteuid() == 0 else ""
        t = self.dir
        (t / "nginx.conf").write_text(f"""
daemon off; {user} pid {t}/nginx.pid; error_log {t}/error.log; worker_processes 2;
events {{}}
http {{
  access_log {t}/access.log;
  client_body_temp_path {t}; proxy_temp_path {t}; fastcgi_temp_path {t};
  uwsgi_temp_path {t}; scgi_temp_path {t};
  server {{ listen {host}:{self.port}; root {self.root}; }}
}}
""")
        self.proc = subprocess.Popen(
            [*wrap, _exe("nginx"), "-c", str(t / "nginx.conf"), "-p", str(t)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _wait_port(host, self.port, self.proc, "nginx")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGQUIT)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def put(self, name, src):
        shutil.copyfile(src, self.root / name)
        return f"http://{self.host}:{self.port}/{name}"


class FaultProxy:
    """An HTTP proxy in front of `upstream` (e.g. an HttpServer) that injects faults
    into its answers to ranged GETs, one in every `every`: `mode` is "503" (Service
    Unavailable, which clients retry), "cut" (the body cut off halfway, then the
    connection closed) or "flip" (one byte of the body changed, a 206 otherwise
    perfect). HEAD requests pass untouched; `mode = None` stops the faults."""

    def __init__(self, upstream_port, mode=None, every=3):
        import http.client
        import http.server
        import threading

        self.mode, self.every, self.count, self.injected = mode, every, 0, 0
        lock = threading.Lock()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def _forward(self, method):
                conn = http.client.HTTPConnection("127.0.0.1", upstream_port, timeout=30)
                headers = {k: v for k, v in self.headers.items() if k.lower() != "host"}
                conn.request(method, self.path, headers=headers)
                r = conn.getresponse()
                body = r.read()
                conn.close()
                fault = None
                if method == "GET" and self.headers.get("Range"):
                    with lock:
                        proxy.count += 1
                        if proxy.mode and proxy.count % proxy.every == 0:
                            fault = proxy.mode
                            proxy.injected += 1
                if fault == "503":
                    self.send_response(503)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                self.send_response(r.status)
                for k, v in r.getheaders():
                    if k.lower() not in ("connection", "transfer-encoding"):
                        self.send_header(k, v)
                self.end_headers()
                if method == "HEAD":
                    return
                if fault == "cut":
                    self.wfile.write(body[: len(body) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                if fault == "flip" and body:
                    body = bytearray(body)
                    body[len(body) // 2] ^= 0x40
                self.wfile.write(body)

            def do_GET(self):
                self._forward("GET")

            def do_HEAD(self):
                self._forward("HEAD")

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def url(self, name):
        return f"http://127.0.0.1:{self.port}/{name}"

    def stop(self):
        self.server.shutdown()
        self.server.server_close()
