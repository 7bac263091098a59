"""Addresses, parsed in one place: ``host:port`` and Mooncake's ``metadata_server``.

* :class:`HostPort` — ``host:port``, ``[ipv6]:port``; ``strict=True`` (the proxy's
  upstreams) also requires an IP literal or a DNS name and brackets around IPv6.
* :class:`MetadataURL` — a ``metadata_server`` string classified the way Mooncake's
  ``parseConnectionString`` does. One vocabulary everywhere: ``kind`` is
  ``"http"`` (also ``https://``), ``"etcd"`` (``etcd://`` or a *bare* ``host:port``,
  which Mooncake treats as etcd — :attr:`MetadataURL.bare` tells them apart),
  ``"redis"``, ``"rediss"``, ``"p2p"`` (``P2PHANDSHAKE``) or any other scheme as
  written (unsupported).

Errors are :class:`~mooncake_vllm.errors.ConfigError` naming the field and the fix.
Like LMCache's single ``parse_remote_url`` → ``ParsedRemoteURL``.
"""

from __future__ import annotations

import ipaddress
import re
import urllib.parse
from dataclasses import dataclass

from mooncake_vllm.errors import ConfigError, ConfigProblem

__all__ = ["HOST_PORT_FIX", "P2P_HANDSHAKE", "HostPort", "MetadataURL", "redact_url"]

P2P_HANDSHAKE = "P2PHANDSHAKE"
HOST_PORT_FIX = "use host:port, [ipv6]:port or dns-name:port, e.g. 127.0.0.1:8100 or [::1]:8100"
# RFC 1123 host name: dot-separated labels of letters, digits and inner hyphens.
_LABEL = re.compile(r"^(?!-)[A-Za-z0-9_-]{1,63}(?<!-)$")


class _Bad(Exception):
    """A problem text; turned into a ConfigError by the public parsers."""


def _port(text: str) -> int:
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise _Bad(f"port {text!r} is not a number in 1..65535")
    return int(text)


@dataclass(frozen=True)
class HostPort:
    """A TCP address; ``host`` is kept without IPv6 brackets."""

    host: str
    port: int

    @property
    def netloc(self) -> str:
        """``host:port``, with brackets around an IPv6 host."""
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    def __str__(self) -> str:
        return self.netloc

    @classmethod
    def parse(cls, text: str, *, field: str = "address", strict: bool = False,
              default_host: str | None = None, shown: str | None = None,
              fix: str = HOST_PORT_FIX) -> HostPort:
        """Parse ``host:port`` / ``[ipv6]:port``; ConfigError naming ``field`` (quoting ``shown``)."""
        try:
            return cls._parse(text, strict=strict, default_host=default_host)
        except _Bad as exc:
            value = text if shown is None else shown
            raise ConfigError(field, [ConfigProblem(field, f"{value!r}: {exc}", fix)]) from None

    @classmethod
    def try_parse(cls, text: str, *, default_host: str | None = None) -> HostPort | None:
        """The lenient :meth:`parse`, or None where it would raise."""
        try:
            return cls._parse(text, strict=False, default_host=default_host)
        except _Bad:
            return None

    @classmethod
    def _parse(cls, text: str, *, strict: bool, default_host: str | None) -> HostPort:
        if not isinstance(text, str) or not text.strip():
            raise _Bad("empty address")
        text = text.strip()
        if text.startswith("["):
            host, sep, rest = text[1:].partition("]")
            if not sep or not rest.startswith(":"):
                raise _Bad("a bracketed IPv6 address needs ']:port' after it")
            if strict:
                try:
                    ipaddress.IPv6Address(host)
                except ValueError:
                    raise _Bad(f"{host!r} is not an IPv6 address") from None
            return cls(host, _port(rest[1:]))
        if ":" not in text:
            raise _Bad("no port")
        if strict and text.count(":") != 1:
            raise _Bad("an IPv6 address must be written in brackets")
        host, _, port_text = text.rpartition(":")
        port = _port(port_text)
        if not host:
            if default_host is None:
                raise _Bad("no host")
            host = default_host
        if strict:
            try:
                ipaddress.IPv4Address(host)
            except ValueError:
                labels = host.split(".")
                if len(host) > 253 or not all(_LABEL.match(lab) for lab in labels):
                    raise _Bad(f"{host!r} is neither an IP address nor a DNS name") from None
            host = host.lower()
        return cls(host, port)


@dataclass(frozen=True)
class MetadataURL:
    """A Mooncake ``metadata_server`` string, classified (see the module docstring)."""

    text: str
    kind: str
    #: the scheme as written, lower-cased; "" for a bare ``host:port`` and P2PHANDSHAKE
    scheme: str

    @property
    def bare(self) -> bool:
        """A ``host:port`` without a scheme (etcd, as Mooncake reads it)."""
        return self.kind == "etcd" and not self.scheme

    @classmethod
    def parse(cls, text: str) -> MetadataURL:
        """Classify ``text``; never raises (validation is :meth:`etcd_endpoints` and the callers')."""
        text = (text or "").strip()
        if text == P2P_HANDSHAKE:
            return cls(text, "p2p", "")
        scheme, sep, _ = text.partition("://")
        if not sep:
            return cls(text, "etcd", "")
        scheme = scheme.lower()
        return cls(text, {"https": "http"}.get(scheme, scheme), scheme)

    def etcd_endpoints(self) -> list[str]:
        """``etcd://h:p,h2:p2`` or bare ``h:p[;h2:p2]`` → ``["http://h:p", ...]``; ConfigError on garbage."""
        body = self.text[len("etcd://"):] if self.scheme == "etcd" else self.text
        endpoints: list[str] = []
        for raw in body.replace(";", ",").split(","):
            item = raw.strip().rstrip("/")
            if not item:
                continue
            scheme = "http"
            if "://" in item:
                scheme, _, item = item.partition("://")
            hp = HostPort.try_parse(item)
            if hp is None:
                raise self._error(f"etcd endpoint {raw.strip()!r} is not host:port",
                                  "use etcd://host:2379 or host:2379 (comma-separated for a cluster)")
            endpoints.append(f"{scheme}://{item.rpartition(':')[0]}:{hp.port}")
        if not endpoints:
            raise self._error("no etcd endpoint given", "use etcd://host:2379")
        return endpoints

    def probe_address(self) -> HostPort | None:
        """The one address to test with TCP before handing the URL to Mooncake, if any:
        an http server's ``host:port``, an etcd cluster's first endpoint."""
        if self.kind == "http":
            return HostPort.try_parse(urllib.parse.urlsplit(self.text).netloc.rpartition("@")[2])
        if self.kind == "etcd":
            try:
                first = self.etcd_endpoints()[0]
            except ConfigError:
                return None
            return HostPort.try_parse(first.partition("://")[2])
        return None

    def _error(self, problem: str, fix: str) -> ConfigError:
        return ConfigError(f"metadata URL {self.text!r}", [ConfigProblem("metadata_server", problem, fix)])


def redact_url(url: str) -> str:
    """``url`` with any ``user:password@`` replaced by ``***@``."""
    parts = urllib.parse.urlsplit(url)
    if "@" not in parts.netloc:
        return url
    return urllib.parse.urlunsplit(parts._replace(netloc="***@" + parts.netloc.rpartition("@")[2]))
