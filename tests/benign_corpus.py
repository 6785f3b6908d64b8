"""Look-alikes that are not credentials and must survive redaction byte for byte
(issue 11): hashes and digests (the runtime's own BLAKE3 among them), identifiers,
integrity strings, base64 data, public keys and certificates, paths, timestamps, long
names in stack traces, secret-sounding names with ordinary values, and the example keys
vendors document as placeholders. Random parts come from a seeded RNG.
"""

from __future__ import annotations

import base64
import hashlib
import random
import string
import uuid

from tests.secret_families import private_key_block

HEX = "0123456789abcdef"


def build(seed: int = 7) -> list[tuple[str, str]]:
    """(name, text) pairs; ``redact(text) == text`` for each."""
    rng = random.Random(seed)

    def r(alphabet: str, n: int) -> str:
        return "".join(rng.choice(alphabet) for _ in range(n))

    def raw(n: int) -> bytes:
        return bytes(rng.getrandbits(8) for _ in range(n))

    sha1, sha256, blake3 = r(HEX, 40), r(HEX, 64), r(HEX, 64)
    u = uuid.UUID(int=rng.getrandbits(128), version=4)
    cert, _ = private_key_block(rng, "CERTIFICATE", 900)
    cases = [
        ("git", f"commit {sha1}\nMerge: {sha1[:7]} {r(HEX, 7)}\n"
                f"HEAD is now at {sha1[:12]} fix auth"),
        ("digests", f"sha256:{sha256}\nsha1={sha1}\nmd5 {hashlib.md5(raw(8)).hexdigest()}"),
        ("runtime digests", f"plan digest {blake3}\nprompts/{blake3}.md\n"
                            f"artifacts/plans/{blake3[:16]}/plan.json\nfingerprint {r(HEX, 64)}"),
        ("uuids", f"request-id {u}\nx-request-id: {uuid.UUID(int=rng.getrandbits(128))}"),
        ("npm integrity", f'"integrity": "sha512-{base64.b64encode(raw(64)).decode()}"\n'
                          '"resolved": "https://registry.npmjs.org/left-pad/-/left-pad-1.3.0.tgz"'),
        ("pip hashes", f"requests==2.32.3 --hash=sha256:{r(HEX, 64)} \\\n"
                       f"    --hash=sha256:{r(HEX, 64)}"),
        ("go sum", f"golang.org/x/net v0.30.0 h1:{base64.b64encode(raw(32)).decode()}"),
        ("docker digest", f"pulling ghcr.io/acme/api@sha256:{r(HEX, 64)}"),
        ("image data", "<img src=\"data:image/png;base64,"
                       f"{base64.b64encode(raw(300)).decode()}\">"),
        ("base64 json", f'{{"nonce": "{base64.b64encode(raw(18)).decode()}", '
                        f'"payload": "{base64.b64encode(b"hello world, attempt 2").decode()}"}}'),
        ("certificate", f"server certificate:\n{cert}\nverify ok"),
        ("ssh public keys", "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAI"
                            f"{base64.b64encode(raw(24)).decode()} ci@runner\n"
                            "ssh-rsa AAAAB3NzaC1yc2EAAAADAQABAAABAQ"
                            f"{base64.b64encode(raw(90)).decode()}"),
        ("paths", "/home/dev/src/auth/token_parser.py:88: in parse\n"
                  "C:\\Users\\dev\\AppData\\Local\\secrets\\cache.db\n"
                  "~/.config/gh/hosts.yml ./scripts/rotate_keys.sh ../secrets/README.md"),
        ("timestamps", "2026-11-30T21:14:03.123456+00:00 1764537243 1764537243123 "
                       "Mon, 30 Nov 2026 21:14:03 GMT"),
        ("java trace", "\tat com.acme.security.auth.TokenValidationServiceImpl.validateAccessToken"
                       "(TokenValidationServiceImpl.java:142)\n\tat org.springframework.security."
                       "oauth2.server.resource.authentication.JwtAuthenticationProvider."
                       "authenticate(JwtAuthenticationProvider.java:97)"),
        ("python trace", 'Traceback (most recent call last):\n  File "/app/secrets_manager.py", '
                         "line 12, in get_secret\n    raise KeyError(key_name)\n"
                         "KeyError: 'db_password'"),
        ("ethereum", f"tx 0x{r(HEX, 64)} from 0x{r(HEX, 40)} selector 0xa9059cbb "
                     f"slot 0x{r(HEX, 64)}"),
        ("aws examples", "AKIAIOSFODNN7EXAMPLE wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY\n"
                         "aws_access_key_id = AKIAIOSFODNN7EXAMPLE\n"
                         "aws_secret_access_key = wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"),
        ("masked examples", "GITHUB_TOKEN=ghp_" + "x" * 36 + "\nstripe sk_live_" + "X" * 24
                            + "\nslack xoxb-0000000000-0000000000-" + "x" * 24),
        ("placeholders", "export GITHUB_TOKEN=${GITHUB_TOKEN}\napi_key: <your-api-key>\n"
                         "password: changeme\ntoken = ${{ secrets.NPM_TOKEN }}\n"
                         "Authorization: Bearer $TOKEN\nDB_PASSWORD=%(db_password)s\n"
                         'password: "{{ vault_password }}"\nsecret_key = os.environ["SECRET_KEY"]\n'
                         "AWS_SECRET_ACCESS_KEY=********\ntoken: [REDACTED]"),
        ("secret-sounding names", "max_tokens: 4096\ntoken_count=118\ntokens_used=123456\n"
                                  "password_reset_url: /account/reset\nsecret_santa.py\n"
                                  "primary_key: id\nsort_key=createdAt\ncache_key=user\n"
                                  '"key": "name"\nkey_id: 7\ntokenizer=cl100k_base\n'
                                  "auth_method: oidc\npassword_policy: strict\n"
                                  "token expired at 2026-11-30T21:00:00Z\nkeyboard layout us\n"
                                  "--token-file /run/secrets/token --password-stdin\n"
                                  "public_key: ssh-ed25519 AAAAC3NzaC1lZDI1NTE5\n"
                                  "AWS Secrets Manager: secret not found"),
        ("urls", "https://deploy@github.com/acme/x.git\nhttp://localhost:8080/@scope/pkg\n"
                 "git@github.com:acme/x.git\nhttps://registry.npmjs.org/@babel%2fcore\n"
                 "postgresql://localhost:5432/billing\nssh://git@host:22/x\n"
                 "mailto:dev@example.com https://example.com/search?q=token&page=2"),
        ("working directories", "workdir: /work/runs/r1/nodes/recon/workspace/artifacts\n"
                                "PWD=/work/runs/r1\nOLDPWD=/home/runner"),
        ("kubernetes", "pod api-7d9f8c6b5-x2k4p Running\nconfigmap/app-config created\n"
                       "arn:aws:iam::123456789012:role/deploy"),
        ("identifiers", f"{r(string.ascii_letters + string.digits, 16)} "
                        "AbstractSingletonProxyFactoryBeanTokenValidatorRegistrationHandler "
                        f"build-{r(HEX, 8)} v1.0-rc2 ipv6 fe80::1"),
        ("runtime cut marker", "exit status 1\n[... 123 characters dropped ...]\nretrying"),
    ]
    return cases
