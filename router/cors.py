"""CORS: which web pages a browser lets call the API (the router's outermost ASGI middleware).

For each HTTP request, when the app's `cors.allowed_origins` is not empty:
  1. a preflight (OPTIONS with Access-Control-Request-Method) is answered here, before the guards
     (router/guards.py): browsers send it without credentials, so it never meets the API key;
     an origin not allowed gets a 400 ("Disallowed CORS origin");
  2. any other request goes on to the guards and the app, and its response (a guard's refusal
     included) carries Access-Control-Allow-Origin when its Origin is allowed.
Empty (the default): no CORS headers, and browsers refuse cross-origin calls. Starlette's
CORSMiddleware does the work; it is built from the settings the Router replica configures at
start, as the guards' settings are.
"""

from __future__ import annotations

from starlette.middleware.cors import CORSMiddleware

METHODS = ("GET", "POST", "DELETE", "OPTIONS")


class CorsSettings:
    """Filled by the Router replica at start; read on every request."""

    def __init__(self):
        self.options: dict | None = None      # CORSMiddleware's keyword arguments; None: CORS off

    def configure(self, allowed_origins: list[str], allow_credentials: bool, max_age_s: int) -> None:
        self.options = None if not allowed_origins else {
            "allow_origins": list(allowed_origins), "allow_methods": list(METHODS), "allow_headers": ["*"],
            "allow_credentials": allow_credentials, "max_age": max_age_s}


class Cors:
    def __init__(self, app, settings: CorsSettings):
        self.app = app
        self.settings = settings
        self._built: tuple[dict | None, object] = (None, app)     # (the options it was built from, the app)

    async def __call__(self, scope, receive, send):
        options, inner = self._built
        if options is not self.settings.options:
            inner = self.app if self.settings.options is None else CORSMiddleware(self.app, **self.settings.options)
            self._built = (self.settings.options, inner)
        await inner(scope, receive, send)
