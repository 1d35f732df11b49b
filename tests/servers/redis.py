"""A private redis-server on its own loopback port, optionally TLS-only and with ACL users."""

import shutil
import subprocess
from pathlib import Path
from urllib.parse import quote, urlencode

from tests.servers import ManagedProcess, free_port, port_open


def make_tls_files(directory):
    """Write a throwaway CA, a server certificate for 127.0.0.1/localhost and a client certificate; return their paths.

    EC keys (fast to make), valid for two days, made with ``openssl`` at test time: nothing secret is
    kept in the repository. Files already there are reused.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    paths = {name: directory / name for name in
             ("ca.crt", "ca.key", "server.crt", "server.key", "client.crt", "client.key")}
    if all(path.exists() for path in paths.values()):
        return paths
    key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]

    def openssl(*args):
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=directory)

    openssl("req", "-x509", *key, "-days", "2", "-subj", "/CN=distlock test CA", "-keyout", "ca.key", "-out", "ca.crt")
    extensions = directory / "san.cnf"
    extensions.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for who in ("server", "client"):
        openssl("req", *key, "-subj", f"/CN=distlock test {who}", "-keyout", f"{who}.key", "-out", f"{who}.csr")
        openssl("x509", "-req", "-in", f"{who}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
                "-days", "2", "-out", f"{who}.crt", "-extfile", "san.cnf")
    return paths


class RedisServer(ManagedProcess):
    """redis-server without persistence by default (``--save '' --appendonly no``), like a cache node.

    ``persistent=True`` gives ``appendonly yes`` + ``appendfsync always`` for the fault scenarios
    that compare the two.

    ``tls=True`` serves TLS only (``--port 0 --tls-port``), with certificates from ``make_tls_files``
    and client certificates required (``tls-auth-clients yes``). ``password`` is the default user's
    (``requirepass``); ``users`` maps ACL user names to ``(password, rules)``, e.g.
    ``{"locks": ("secret", "~distlock:* &* +@all")}``. ``url`` connects as the default user with
    whatever it needs; ``url_for()`` as another user.
    """

    def __init__(self, port=None, *, persistent=False, workdir=None, name=None, tls=False, password=None,
                 users=None):
        self.port = port or free_port()
        super().__init__(name or f"redis-{self.port}", workdir)
        self.persistent = persistent
        self.tls = tls
        self.password = password
        self.users = dict(users or {})
        self.tls_files = None

    @property
    def url(self):
        return self.url_for(None, self.password)

    def url_for(self, username, password, *, tls_parameters=True):
        """The URL of this server as ``username`` (None: the default user), TLS parameters included if ``tls``."""
        scheme = "rediss" if self.tls else "redis"
        userinfo = ""
        if password is not None:
            userinfo = f"{quote(username or '', safe='')}:{quote(password, safe='')}@"
        query = f"?{urlencode(self.tls_parameters())}" if self.tls and tls_parameters else ""
        return f"{scheme}://{userinfo}127.0.0.1:{self.port}/0{query}"

    def tls_parameters(self):
        """redis-py's TLS keyword arguments for this server, as ``from_url`` takes them from a URL's query."""
        files = self.tls_files or make_tls_files(self.workdir / "tls")
        return {"ssl_ca_certs": str(files["ca.crt"]), "ssl_certfile": str(files["client.crt"]),
                "ssl_keyfile": str(files["client.key"]), "ssl_cert_reqs": "required"}

    def prepare(self):
        if self.tls:
            self.tls_files = make_tls_files(self.workdir / "tls")

    def command(self):
        binary = shutil.which("redis-server") or "/usr/bin/redis-server"
        persistence = ["--appendonly", "yes", "--appendfsync", "always"] if self.persistent else [
            "--save", "", "--appendonly", "no"]
        if self.tls:
            files = self.tls_files
            listen = ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", str(files["server.crt"]),
                      "--tls-key-file", str(files["server.key"]), "--tls-ca-cert-file", str(files["ca.crt"]),
                      "--tls-auth-clients", "yes"]
        else:
            listen = ["--port", str(self.port)]
        security = ["--requirepass", self.password] if self.password is not None else []
        for user, (password, rules) in self.users.items():
            security += ["--user", user, "on", f">{password}", *rules.split()]
        return [binary, "--bind", "127.0.0.1", *listen, "--dir", str(self.workdir),
                "--daemonize", "no", "--protected-mode", "no", *persistence, *security]

    def ready(self):
        return port_open(self.port) and "Ready to accept connections" in self.new_logs()


def start_redis(tmp):
    """The single Redis instance of the contract suite."""
    server = RedisServer(workdir=f"{tmp}/redis").start()
    return {"DISTLOCK_TEST_REDIS_URL": server.url}, [server]


def start_redlock(tmp):
    """Five independent Redis masters for the Redlock backend."""
    servers = [RedisServer(workdir=f"{tmp}/redlock-{i}").start() for i in range(5)]
    return {"DISTLOCK_TEST_REDLOCK_URLS": ",".join(server.url for server in servers)}, servers
