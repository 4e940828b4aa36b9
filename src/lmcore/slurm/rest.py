"""slurmrestd: the REST transport of the one SLURM client.

A command that runs through a cluster profile's slurmrestd (the profile's ``submit: {via: rest,
url: ...}``, or ``lmlaunch --rest PROFILE ...``) has lmcore.slurm.client hand its queries and
controls here, and gets the same records back (rest_records.py turns the server's JSON into them).

- **Auth** by JWT (slurmrestd(8), rest_auth/jwt): each request carries X-SLURM-USER-NAME and
  X-SLURM-USER-TOKEN. The token comes from the profile's ``token_file`` (mode 0600 or stricter,
  either the bare token or ``scontrol token``'s ``SLURM_JWT=...`` line), else $SLURM_JWT, else
  ``scontrol token``. It is never printed or logged: messages name where it came from.
- **The API version** is negotiated: of the data_parser versions the server's OpenAPI document
  offers (``GET /openapi/v3``), the newest this client speaks, or the one the profile pins.
- **Errors** are the server's own words, exit 2: a URL that does not answer, a token refused
  (401), a version the server does not offer, a job it rejects.
"""

from __future__ import annotations

import base64
import http.client
import json
import os
import re
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from lmcore.errors import ExitCode, SlurmUnavailable, UserError
from lmcore.slurm import versions

# The data_parser versions this client speaks, newest first: those the tested releases serve
# (lmcore.slurm.versions; 24.11 v0.0.40 to v0.0.42, 26.05 v0.0.42 to v0.0.45). Their job records
# and job descriptions share the fields used here.
KNOWN_APIS = versions.rest_apis()
REQUEUE_API = "v0.0.45"  # the first with GET /slurm/<v>/job/{job_id}/requeue and /slurm/<v>/conf
DEFAULT_TIMEOUT_S = 20.0
Via = Literal["sbatch", "rest"]  # the two ways to SLURM: its commands here, or slurmrestd
JWT = re.compile(r"[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+\.[A-Za-z0-9_-]*")  # header.payload.signature, base64url


class RestError(UserError):
    """slurmrestd refused or did not answer: its words, exit 2, nothing half-done."""

    def __init__(self, message: str) -> None:
        super().__init__(message, exit_code=ExitCode.USAGE)


class RestUnanswered(RestError):
    """No answer: refused, timed out, or not HTTP. ``sent``: a request body went out first (a
    submission may have been queued all the same)."""

    def __init__(self, message: str, *, sent: bool) -> None:
        super().__init__(message)
        self.sent = sent


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    """slurmrestd never redirects: a redirect would carry the token's header to another address."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # type: ignore[no-untyped-def]
        raise urllib.error.HTTPError(req.full_url, code, f"redirected to {newurl}: refused (the token stays here)",
                                     headers, fp)


_OPENER = urllib.request.build_opener(_NoRedirects)


@dataclass(frozen=True)
class RestTarget:
    """Where a cluster's slurmrestd is and how to authenticate (a profile's ``submit`` section)."""

    url: str
    token_file: str | None = None
    user: str | None = None  # X-SLURM-USER-NAME; default: the token's own user
    api: str | None = None  # a pinned data_parser version; default: negotiated
    profile: str = ""  # for messages

    def to_json(self) -> dict[str, Any]:
        return {"url": self.url, "token_file": self.token_file, "user": self.user, "api": self.api, "profile": self.profile}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> RestTarget:
        return cls(str(d["url"]), d.get("token_file"), d.get("user"), d.get("api"), str(d.get("profile", "")))

    @property
    def where(self) -> str:
        return f"slurmrestd at {self.url}" + (f" (profile '{self.profile}')" if self.profile else "")


def read_token_file(path: str) -> str:
    """The JWT in ``path``: refused when others may read it, and never echoed."""
    p = os.path.expanduser(path)
    try:
        st = os.stat(p)
        with open(p, encoding="ascii") as f:
            text = f.read(65536).strip()
    except OSError as exc:
        raise RestError(f"token_file {path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise RestError(f"token_file {path} holds no JWT (not ASCII text)") from None
    if st.st_mode & 0o077:
        raise RestError(f"token_file {path} is open to other users (mode {st.st_mode & 0o777:o}); "
                        f"a token is a password: `chmod 600 {path}`")
    token = text.removeprefix("SLURM_JWT=").strip()
    if not JWT.fullmatch(token):
        raise RestError(f"token_file {path} holds no JWT (expected the token, or `scontrol token`'s SLURM_JWT=... line)")
    return token


def token_claims(token: str) -> dict[str, Any]:
    """The token's payload (not verified: the server does that), for its user and expiry."""
    try:
        payload = token.split(".")[1]
        return dict(json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4))))
    except (IndexError, ValueError, TypeError):
        return {}


@dataclass(eq=False)  # one client per command; never shown with its token or environment
class RestClient:
    target: RestTarget
    timeout: float = DEFAULT_TIMEOUT_S
    environ: dict[str, str] = field(default_factory=lambda: dict(os.environ), repr=False)
    scontrol_token: Callable[[], str] | None = field(default=None, repr=False)  # `scontrol token`'s output
    _token: tuple[str, str] | None = field(default=None, repr=False)  # (token, where it came from)
    _token_mtime: float | None = field(default=None, repr=False)  # its file's, when read
    _api: str | None = None
    _offered: tuple[str, ...] = ()
    _job_fields: tuple[str, ...] = ()
    release: str = ""

    # ------------------------------------------------------------------ auth

    def token(self) -> tuple[str, str]:
        """(the token, where it came from). Read again when its file changed or it expired since it
        was read: a long-lived command (metrics serve, status --watch, a search's driver) follows
        a token file that is renewed beside it."""
        if self._token is not None and (self._stale() or self._file_changed()):
            self._token = None
        if self._token is None:
            if self.target.token_file:
                tok, source = read_token_file(self.target.token_file), f"token_file {self.target.token_file}"
            elif self.environ.get("SLURM_JWT"):
                tok, source = self.environ["SLURM_JWT"].strip(), "$SLURM_JWT"
                if not JWT.fullmatch(tok):
                    raise RestError("$SLURM_JWT holds no JWT (expected header.payload.signature)")
            elif self.scontrol_token is not None:
                tok, source = _token_line(self.scontrol_token()), "`scontrol token`"
            else:
                raise RestError(f"{self.target.where}: no token: set the profile's submit.token_file (mode 600) "
                                "or $SLURM_JWT (`scontrol token` on the cluster makes one)")
            exp = token_claims(tok).get("exp")
            if isinstance(exp, (int, float)) and exp < time.time():
                when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(exp))
                raise RestError(f"the token from {source} expired at {when}: make a new one "
                                "(`scontrol token lifespan=SECONDS` on the cluster)")
            self._token = (tok, source)
            self._token_mtime = self._mtime()
        return self._token

    def _mtime(self) -> float | None:
        try:
            return os.stat(os.path.expanduser(self.target.token_file)).st_mtime if self.target.token_file else None
        except OSError:
            return None

    def _file_changed(self) -> bool:
        return self.target.token_file is not None and self._mtime() != self._token_mtime

    def _stale(self) -> bool:
        exp = token_claims(self._token[0]).get("exp") if self._token else None
        return isinstance(exp, (int, float)) and exp < time.time()

    def user(self) -> str:
        if self.target.user:
            return self.target.user
        sun = token_claims(self.token()[0]).get("sun")
        if isinstance(sun, str) and sun:
            return sun
        import getpass

        return getpass.getuser()

    # ------------------------------------------------------------------ HTTP

    def request(self, method: str, path: str, *, query: dict[str, str] | None = None,
                body: dict[str, Any] | None = None, missing_ok: bool = False) -> dict[str, Any]:
        """One call; the JSON answer. HTTP and server errors are RestErrors in the server's words
        (a 404 with ``missing_ok``: an empty answer)."""
        url = self.target.url.rstrip("/") + path + (("?" + urllib.parse.urlencode(query)) if query else "")
        token, source = self.token()
        headers = {"X-SLURM-USER-NAME": self.user(), "X-SLURM-USER-TOKEN": token, "Accept": "application/json"}
        data = None
        if body is not None:
            data, headers["Content-Type"] = json.dumps(body).encode(), "application/json"
        try:
            req = urllib.request.Request(url, data=data, headers=headers, method=method)
            with _OPENER.open(req, timeout=self.timeout) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as exc:
            try:
                text = exc.read().decode(errors="replace")
            except (OSError, http.client.HTTPException):
                text = ""
            if exc.code == 401:
                raise self.refused(f"HTTP 401: {_first(text) or exc.reason}") from None
            if exc.code == 404 and missing_ok:
                return {}
            words = _server_words(_json(text.encode()) or {}) or _first(text) or str(exc.reason)
            if "authentication" in words.lower():  # slurmctld refused the token slurmrestd passed on
                raise self.refused(f"{words}, HTTP {exc.code}") from None
            raise RestError(f"{self.target.where}: {method} {path}: {words} (HTTP {exc.code})") from None
        except (urllib.error.URLError, OSError, http.client.HTTPException, ValueError) as exc:
            reason = getattr(exc, "reason", None) or type(exc).__name__
            raise RestUnanswered(f"{self.target.where} does not answer ({reason}); check the profile's submit.url "
                                 "and that slurmrestd runs", sent=data is not None) from None
        answer = _json(raw)
        if answer is None:
            raise RestError(f"{self.target.where}: {method} {path} answered with something that is not slurmrestd's "
                            f"JSON: {_first(raw.decode(errors='replace'))!r} (a proxy or login page at submit.url?)")
        words = _server_words(answer)
        if words and "authentication" in words.lower():
            raise self.refused(words)
        if words:
            raise RestError(f"{self.target.where}: {method} {path}: {words}")
        return answer

    # ------------------------------------------------------------------ version

    def api(self) -> str:
        """The data_parser version to use (negotiated once)."""
        if self._api is None:
            doc = self.request("GET", "/openapi/v3")
            offered = sorted({m.group(1) for p in doc.get("paths", {}) if (m := re.match(r"/slurm/(v\d+\.\d+\.\d+)/", p))})
            info = doc.get("info", {})
            self.release = str(info.get("x-slurm", {}).get("release") or info.get("version", "")).removeprefix("Slurm-")
            api = choose_api(offered, self.target.api, self.target.where)
            schema = doc.get("components", {}).get("schemas", {}).get(f"{api}_job_desc_msg", {})
            self._offered, self._job_fields = tuple(offered), tuple(schema.get("properties", {}))
            self._api = api  # last: another thread that sees it sees the rest
        return self._api

    def job_fields(self) -> tuple[str, ...]:
        self.api()
        return self._job_fields

    # ------------------------------------------------------------------ calls

    def ping(self) -> bool:
        """The controller answers slurmrestd. slurmrestd passes the token on to slurmctld, which
        judges it: a token it refuses is a RestError here (the ping says "Protocol authentication
        error"), not a controller that is down."""
        pings = self.request("GET", f"/slurm/{self.api()}/ping/").get("pings", [])
        if any(p.get("responding") or p.get("pinged") == "UP" for p in pings):
            return True
        said = "; ".join(str(p.get("status", "")) for p in pings if p.get("status"))
        if "authentication" in said.lower():
            raise self.refused(said)
        if not said:  # 24.11's ping says only DOWN: its statistics call says why (a refused token raises)
            try:
                self.request("GET", f"/slurm/{self.api()}/diag/")
            except RestError as exc:
                if "refused the token" in exc.message:
                    raise
        return False

    def refused(self, said: str) -> RestError:
        _, source = self.token()
        return RestError(f"{self.target.where}: SLURM refused the token from {source} for user '{self.user()}' "
                         f"({said}): it may have expired, name another user, or be signed with another key than "
                         "the cluster's jwt_key")

    def check_fields(self, body: dict[str, Any]) -> None:
        """Every field of the job description is one the server's API has."""
        offered = set(self.job_fields())
        extra = sorted(k for k in body["job"] if offered and k not in offered)
        if extra:
            raise RestError(f"{self.target.where} (API {self.api()}, SLURM {self.release or '?'}) has no job field "
                            f"{', '.join(extra)}: the job's options need a newer slurmrestd, or submit with sbatch")

    def submit(self, body: dict[str, Any]) -> str:
        self.check_fields(body)
        answer = self.request("POST", f"/slurm/{self.api()}/job/submit", body=body)
        job_id = answer.get("job_id")
        if job_id in (None, "", 0):
            raise RestError(f"{self.target.where} answered the submission without a job id: {_first(json.dumps(answer))}")
        return str(job_id)

    def jobs(self) -> list[dict[str, Any]]:
        """Every job the controller knows (one call, as squeue)."""
        return _listed(self.request("GET", f"/slurm/{self.api()}/jobs/"), "jobs", self.target.where)

    def job(self, job_id: str) -> list[dict[str, Any]]:
        """The controller's records of one job (an array: its tasks); [] once it forgot it."""
        try:
            answer = self.request("GET", f"/slurm/{self.api()}/job/{job_id}", missing_ok=True)
        except RestError as exc:
            if "Invalid job id" in exc.message or "Unable to query JobId" in exc.message:
                return []
            raise
        return list(answer.get("jobs", []))

    def accounted(self, job_ids: list[str], *, duplicates: bool) -> list[dict[str, Any]]:
        query = {"step": ",".join(job_ids)}
        if duplicates:
            query["show_duplicates"] = "true"
        return _listed(self.request("GET", f"/slurmdb/{self.api()}/jobs/", query=query), "jobs", self.target.where)

    def cancel(self, job_id: str, signal: str | None = None) -> None:
        query = {"signal": signal if signal.startswith("SIG") or signal.isdigit() else "SIG" + signal} if signal else None
        self.request("DELETE", f"/slurm/{self.api()}/job/{job_id}", query=query)

    def conf(self) -> dict[str, Any]:
        """slurm.conf as the controller runs it (v0.0.45's /conf)."""
        if not self.offers(REQUEUE_API):
            raise SlurmUnavailable(f"{self.target.where} (API {self.api()}) does not serve the cluster's configuration "
                                   f"({REQUEUE_API}, SLURM 26.05, does)")
        return dict(self.request("GET", f"/slurm/{REQUEUE_API}/conf").get("slurm_conf", {}))

    def requeue(self, job_id: str) -> None:
        if not self.offers(REQUEUE_API):
            raise RestError(f"{self.target.where} (API {self.api()}) has no job requeue endpoint (SLURM 26.05's "
                            f"{REQUEUE_API} adds it); requeue on the cluster with `scontrol requeue {job_id}`")
        self.request("GET", f"/slurm/{REQUEUE_API}/job/{job_id}/requeue")

    def offers(self, api: str) -> bool:
        """The server offers ``api`` (an endpoint only a newer API has is asked there)."""
        self.api()
        return api in self._offered


def choose_api(offered: list[str], pinned: str | None, where: str) -> str:
    """The pinned version if the server offers it, else the newest offered that this client speaks."""
    listed = ", ".join(offered) or "none"
    if pinned:
        if pinned not in offered:
            raise RestError(f"{where} does not offer API {pinned} (the profile's submit.api); it offers: {listed}")
        if pinned not in KNOWN_APIS:
            raise RestError(f"submit.api {pinned}: lmlaunch speaks {', '.join(KNOWN_APIS)}")
        return pinned
    for api in KNOWN_APIS:
        if api in offered:
            return api
    raise RestError(f"{where} offers API {listed}; lmlaunch speaks {KNOWN_APIS[-1]} to {KNOWN_APIS[0]} "
                    "(SLURM 23.11 and later)")


def _token_line(out: str) -> str:
    m = re.search(r"SLURM_JWT=(\S+)", out)
    if m is None:
        raise RestError("`scontrol token` gave no token (does the cluster set AuthAltTypes=auth/jwt?)")
    return m.group(1)


def _json(raw: bytes) -> dict[str, Any] | None:
    """The answer as a JSON object; None when it is not one."""
    try:
        value = json.loads(raw or b"{}")
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _listed(answer: dict[str, Any], key: str, where: str) -> list[dict[str, Any]]:
    value = answer.get(key)
    if not isinstance(value, list):
        raise RestError(f"{where} answered without its {key!r} list (another API, or not slurmrestd?)")
    return [v for v in value if isinstance(v, dict)]


def _server_words(answer: dict[str, Any]) -> str:
    """The server's errors (``errors: [{description, error, ...}]``), joined."""
    parts = []
    for e in answer.get("errors", []) or []:
        if isinstance(e, dict):
            text = "; ".join(str(e[k]) for k in ("description", "error") if e.get(k))
            if text:
                parts.append(text)
    return " | ".join(parts)


def _first(text: str) -> str:
    return text.strip().splitlines()[0][:300] if text.strip() else ""
