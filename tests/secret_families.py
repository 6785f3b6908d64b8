# ruff: noqa: E501  (one spec a line reads better than wrapped templates)
"""One generated, format-valid FAKE sample per credential family of the public scanner
catalogues, each inside a realistic log line.

The catalogue: the rule ids of Kingfisher 1.5.0's bundled rules at low confidence
(``Rules(confidence="low").metadata()``: 488 rules; its ``betterleaks.*`` ids are the ids
of gitleaks' default configuration plus newer ones, ``veles.secrets/*`` come from
Google's Veles), plus gitleaks' ``generic-api-key`` and the forms named in issue 11
that neither catalogue has (PuTTY keys, Docker ``auth``, Azure SAS, .netrc, .pgpass).

Each spec is written here from the family's published format (prefix, alphabet,
length); no rule text is copied. A template holds literal text, ``{<class><n>}`` random
fields and ``[[...]]`` around each secret span. Classes: a alnum, l lower alnum, u upper
alnum, h hex, H upper hex, d digits, s url-safe (alnum - _), b base64 (alnum + /), A
letters, L lower letters, t base32 lower, T base32 upper, c bech32 upper, m base58.
Values come from a seeded RNG: the repository holds no credential, real or fake, and the
corpus is the same on every machine. ``benchmarks/redaction.py --check-samples`` runs
Kingfisher over every sample and reports the ones its own rule for the family misses.
"""

from __future__ import annotations

import base64
import json
import random
import re
import string
from dataclasses import dataclass

_LOWER, _UPPER, _DIGITS = string.ascii_lowercase, string.ascii_uppercase, string.digits
CLASSES = {
    "a": _LOWER + _UPPER + _DIGITS, "l": _LOWER + _DIGITS, "u": _UPPER + _DIGITS,
    "h": "0123456789abcdef", "H": "0123456789ABCDEF", "d": _DIGITS,
    "s": _LOWER + _UPPER + _DIGITS + "-_", "b": _LOWER + _UPPER + _DIGITS + "+/",
    "A": _LOWER + _UPPER, "L": _LOWER, "t": _LOWER + "234567", "T": _UPPER + "234567",
    "c": "QPZRY9X8GF2TVDW0S3JN54KHCE6MUA7L",
    "m": "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz",
}
_FIELD = re.compile(r"\{([a-zA-Z])(\d+)\}")

# (family, template). Bare templates (no context of their own) are placed in one of the
# neutral log lines below, chosen by position, so format rules are tested without a
# helpful variable name next to them.
SPECS: list[tuple[str, str]] = [
    ('1password-secret-key', 'op account add --secret-key [[A3-{u6}-{u11}-{u5}-{u5}-{u5}]]'),
    ('1password-service-account-token', 'export OP_SERVICE_ACCOUNT_TOKEN=[[ops_eyJ{b300}]]'),
    ('abuseipdb-api-key.1', 'export ABUSEIPDB_API_KEY=[[{h80}]]'),
    ('adafruit-api-key', 'export ADAFRUIT_API_KEY=[[{l32}]]'),
    ('adobe-client-id', 'export ADOBE_CLIENT_ID=[[{h32}]]'),
    ('adobe-client-secret', '[[p8e-{l32}]]'),
    ('age-secret-key', '[[AGE-SECRET-KEY-1{c58}]]'),
    ('aikido-ci-token', '[[AIK_CI_{a32}]]'),
    ('aikido-client-id', '[[AIK_CLIENT_{a24}]]'),
    ('aikido-client-secret', '[[AIK_SECRET_{a64}]]'),
    ('airtable-api-key', 'export AIRTABLE_API_KEY=[[{l17}]]'),
    ('airtable-oauth-token', 'export AIRTABLE_OAUTH_TOKEN=[[{u24}.v1.{u24}.{h24}]]'),
    ('airtable-personnal-access-token', '[[pat{a14}.{h64}]]'),
    ('aiven-auth-token', 'AIVEN_AUTH_TOKEN=[[{b372}]]'),
    ('algolia-api-key', 'export ALGOLIA_API_KEY=[[{l32}]]'),
    ('algolia-application-id', 'export ALGOLIA_APPLICATION_ID=[[{l10}]]'),
    ('alibaba-access-key-id', '[[LTAI{a19}]]'),
    ('alibaba-secret-key', 'export ALIBABA_SECRET_KEY=[[{a30}]]'),
    ('alibaba-sts-access-key-id', '[[STS.{a40}]]'),
    ('alibaba-sts-access-key-secret', 'export ALIBABA_STS_ACCESS_KEY_SECRET=[[{a47}]]'),
    ('alibaba-sts-security-token', 'export ALIBABA_STS_SECURITY_TOKEN=[[CAIS{s510}{s12}]]'),
    ('amplitude-secret-key', 'amplitude init: SECRET_KEY=[[{h32}]]'),
    ('anthropic-admin-api-key', '[[sk-ant-admin01-{s93}AA]]'),
    ('anthropic-api-key', '[[sk-ant-api03-{s93}AA]]'),
    ('apify-api-token', '[[apify_api_{a36}]]'),
    ('apollo-api-key.1', 'export APOLLO_API_KEY=[[{s22}]]'),
    ('artifactory-api-key', '[[AKCp{a69}]]'),
    ('artifactory-jfrog-url', 'pip index https://[[acme-corp.jfrog.io]]/artifactory/api/pypi/simple'),
    ('artifactory-reference-token', '[[cmVmd{a59}]]'),
    ('asaas-api-token', 'access_token: [[$aact_prod_{s60}]]'),
    ('asana-client-id', 'export ASANA_CLIENT_ID=[[{d16}]]'),
    ('asana-client-secret', 'export ASANA_CLIENT_SECRET=[[{l32}]]'),
    ('assemblyai-api-key', 'export ASSEMBLYAI_API_KEY=[[{l32}]]'),
    ('atlassian-api-token', '[[ATATT3xFfGF0{s180}]]'),
    ('auth0-client-id.1', 'export AUTH0_CLIENT_ID=[[{s46}]]'),
    ('auth0-client-secret.1', 'export AUTH0_CLIENT_SECRET=[[{s96}]]'),
    ('auth0-domain.1', 'issuer https://[[acme-{l8}.eu.auth0.com]]/'),
    ('authress-service-client-access-key', 'AUTHRESS_KEY=[[sc_{l20}.{l5}.acc_{l20}.{s60}]]'),
    ('aws-access-token', 'aws sts: key [[AKIA{T16}]] rejected'),
    ('aws-amazon-bedrock-api-key-long-lived', 'AWS_BEARER_TOKEN_BEDROCK=[[ABSK{b132}]]'),
    ('aws-amazon-bedrock-api-key-short-lived', '[[bedrock-api-key-YmVkcm9jay5hbWF6b25hd3MuY29t]]'),
    ('aws-secret-access-key', 'export AWS_SECRET_ACCESS_KEY=[[{b40}]]'),
    ('aws-session-token', 'AWS_SESSION_TOKEN=[[{b300}]]'),
    ('azure-ad-client-secret', 'AZURE_CLIENT_SECRET=[[{a3}8Q~{s34}]]'),
    ('azure-app-configuration-connection-string', 'Endpoint=https://acme-cfg.azconfig.io;Id={a4}-l0-s0:{a20};Secret=[[{b43}=]]'),
    ('azure-client-id', 'AZURE_CLIENT_ID=[[{h8}-{h4}-{h4}-{h4}-{h12}]]'),
    ('azure-servicebus-connection-string', 'Endpoint=sb://acme-bus.servicebus.windows.net/;SharedAccessKeyName=RootManageSharedAccessKey;SharedAccessKey=[[{b43}=]]'),
    ('azure-storage-account-key', 'DefaultEndpointsProtocol=https;AccountName=acmelogs;AccountKey=[[{b86}==]];EndpointSuffix=core.windows.net'),
    ('azure-storage-account-name', 'https://[[acmelogs{l4}]].blob.core.windows.net/container/x.log 403'),
    ('azure-tenant-id', 'AZURE_TENANT_ID=[[{h8}-{h4}-{h4}-{h4}-{h12}]]'),
    ('beamer-api-token', 'export BEAMER_API_TOKEN=[[b_{l44}]]'),
    ('bitbucket-client-id', 'export BITBUCKET_CLIENT_ID=[[{l32}]]'),
    ('bitbucket-client-secret', 'export BITBUCKET_CLIENT_SECRET=[[{l64}]]'),
    ('bitbucket-data-center-token', '[[BBDC-{b32}]]'),
    ('bitly-access-token', 'BITLY_ACCESS_TOKEN=[[{h40}]]'),
    ('bitrise-access-token', 'export BITRISE_ACCESS_TOKEN=[[{s90}]]'),
    ('bittrex-access-key', 'export BITTREX_ACCESS_KEY=[[{l32}]]'),
    ('bittrex-secret-key', 'export BITTREX_SECRET_KEY=[[{l32}]]'),
    ('box-api-access-token', 'export BOX_API_ACCESS_TOKEN=[[{l32}]]'),
    ('brave-search-api-key', '[[BSA{s32}]]'),
    ('browserstack-access-key.1', 'export BROWSERSTACK_ACCESS_KEY=[[{a20}]]'),
    ('browserstack-username.1', 'export BROWSERSTACK_USERNAME=[[{a1}{s20}]]'),
    ('buildkite-service-token', 'BUILDKITE_AGENT_TOKEN=[[bkaa_{s75}]]'),
    ('buildkite-user-access-token', 'buildkite-agent: using [[bkua_{l40}]]'),
    ('canadian-digital-service-notify-api-key', 'notify client: [[ApiKey-v1 gcntfy-acme-{h8}-{h4}-{h4}-{h4}-{h12}-{h8}-{h4}-{h4}-{h4}-{h12}]]'),
    ('canva-client-id', 'CANVA_CLIENT_ID=[[OC-{s12}]]'),
    ('canva-client-secret', '[[cnvca{s51}]]'),
    ('cartesia-api-key.1', '[[sk_car_{a20}]]'),
    ('cerebras-api-key', '[[csk-{l48}]]'),
    ('checkout-secret-key', 'export CHECKOUT_SECRET_KEY=[[sk_{h8}-{h4}-{h4}-{h4}-{h12}]]'),
    ('circleci-personal-token', '[[CCIPAT_{a22}_{l40}]]'),
    ('circleci-project-token', 'export CIRCLECI_PROJECT_TOKEN=[[{h40}]]'),
    ('cisco-meraki-api-key', 'export CISCO_MERAKI_API_KEY=[[{h40}]]'),
    ('civo-api-key', 'export CIVO_API_KEY=[[{l50}]]'),
    ('clerk-secret-key', 'CLERK_SECRET_KEY=[[sk_live_{a32}]]'),
    ('clickhouse-cloud-api-secret-key', '[[4b1d{a38}]]'),
    ('clickhouse-cloud-key-id', 'CLICKHOUSE_KEY_ID=[[{l20}]]'),
    ('clickup-personal-api-token', 'export CLICKUP_PERSONAL_API_TOKEN=[[pk_{d8}_{l32}]]'),
    ('clojars-api-token', '[[CLOJARS_{l60}]]'),
    ('cloudflare-account-id.1', 'export CLOUDFLARE_ACCOUNT_ID=[[{h32}]]'),
    ('cloudflare-api-key.1', 'export CLOUDFLARE_API_KEY=[[{l40}]]'),
    ('cloudflare-api-key.2', 'cloudflare: [[cfut_{a40}{h8}]]'),
    ('cloudflare-global-api-key', 'export CLOUDFLARE_GLOBAL_API_KEY=[[{h37}]]'),
    ('cloudflare-origin-ca-key', '[[v1.0-{h24}-{h146}]]'),
    ('cloudinary-api-key', 'CLOUDINARY_API_KEY=[[{d15}]]'),
    ('cloudinary-api-secret', 'CLOUDINARY_API_SECRET=[[{a32}]]'),
    ('cloudinary-cloud-name', 'CLOUDINARY_CLOUD_NAME=[[acme{l8}]]'),
    ('cloudsmith-api-key', '[[csa_{h30}{a6}]]'),
    ('cockroachlabs-cloud-api-key', '[[CCDB1_{a22}_{a40}]]'),
    ('codecov-access-token', 'export CODECOV_ACCESS_TOKEN=[[{u36}]]'),
    ('cohere-api-token', 'export COHERE_API_TOKEN=[[{a40}]]'),
    ('coinbase-access-token', 'export COINBASE_ACCESS_TOKEN=[[{l64}]]'),
    ('configcat-sdk-key', 'export CONFIGCAT_SDK_KEY=[[{s22}/{s22}]]'),
    ('configcat-sdk-key-extended', '[[configcat-sdk-1/{s22}/{s22}]]'),
    ('confluent-access-token', 'export CONFLUENT_ACCESS_TOKEN=[[{l16}]]'),
    ('confluent-secret-key', 'export CONFLUENT_SECRET_KEY=[[{l64}]]'),
    ('contentful-delivery-api-token', 'export CONTENTFUL_DELIVERY_API_TOKEN=[[{l43}]]'),
    ('couchbase-capella-api-key', 'COUCHBASE_CAPELLA_API_KEY_SECRET=[[{b80}]]'),
    ('coveralls-personal-api-token', 'export COVERALLS_PERSONAL_API_TOKEN=[[{a37}]]'),
    ('crates-io-api-key', 'export CRATES_IO_API_KEY=[[cio{a32}]]'),
    ('curl-auth-header', 'curl -sS -H "Authorization: Bearer [[{s40}]]" https://api.example.net/v1/items'),
    ('curl-auth-user', 'curl -sS -u "deploy:[[{a20}]]" https://ci.example.net/api/json'),
    ('cursor-api-key', 'export CURSOR_API_KEY=[[key_{h64}]]'),
    ('databento-api-key', 'export DATABENTO_API_KEY=[[db-{a29}]]'),
    ('databricks-api-token', 'DATABRICKS_HOST=https://dbc.cloud.databricks.com token [[dapi{h32}]]'),
    ('datadog-api-key', 'export DATADOG_API_KEY=[[{l32}]]'),
    ('datadog-application-key', 'export DATADOG_APPLICATION_KEY=[[{a40}]]'),
    ('datagov-api-key', 'export DATAGOV_API_KEY=[[{l40}]]'),
    ('datastax-astra-application-token', '[[AstraCS:{a20}]]'),
    ('deepgram-api-key', 'export DEEPGRAM_API_KEY=[[{h40}]]'),
    ('deepseek-api-key', 'DEEPSEEK_API_KEY=[[sk-{h32}]]'),
    ('defined-networking-api-token', 'export DEFINED_NETWORKING_API_TOKEN=[[dnkey-{l26}-{l52}]]'),
    ('deno-account-token', '[[ddp_{a36}]]'),
    ('devcycle-client-sdk-key', '[[dvc_client_{a20}]]'),
    ('devcycle-mobile-sdk-key', '[[dvc_mobile_{a20}]]'),
    ('devcycle-server-sdk-key', '[[dvc_server_{a20}]]'),
    ('devin-personal-api-key', 'DEVIN_API_KEY=[[apk_user_{b150}]]'),
    ('devin-service-api-key', 'DEVIN_API_KEY=[[apk_{b90}]]'),
    ('devin-service-user-token', '[[cog_{L52}]]'),
    ('digitalocean-access-token', '[[doo_v1_{h64}]]'),
    ('digitalocean-pat', '[[dop_v1_{h64}]]'),
    ('digitalocean-refresh-token', '[[dor_v1_{h64}]]'),
    ('discord-api-token', 'export DISCORD_API_TOKEN=[[{h64}]]'),
    ('discord-client-id', 'export DISCORD_CLIENT_ID=[[{d18}]]'),
    ('discord-client-secret', 'export DISCORD_CLIENT_SECRET=[[{l32}]]'),
    ('disqus-api-key', 'export DISQUS_API_KEY=[[{l64}]]'),
    ('docker-swarm-join-token', '[[SWMTKN-1-{l55}-{l27}]]'),
    ('docker-swarm-unlock-key', '[[SWMKEY-1-{b45}]]'),
    ('dockerhub-organization-access-token', '[[dckr_oat_{s32}]]'),
    ('dockerhub-personal-access-token', '[[dckr_pat_{s27}]]'),
    ('doppler-api-token', '[[dp.pt.{l43}]]'),
    ('droneci-access-token', 'export DRONECI_ACCESS_TOKEN=[[{l32}]]'),
    ('dropbox-api-token', 'export DROPBOX_API_TOKEN=[[{l15}]]'),
    ('dropbox-long-lived-api-token', 'export DROPBOX_LONG_LIVED_API_TOKEN=[[{l11}AAAAAAAAAA{l43}]]'),
    ('dropbox-short-lived-api-token', 'export DROPBOX_SHORT_LIVED_API_TOKEN=[[sl.{l135}]]'),
    ('duffel-api-token', 'duffel: [[duffel_live_{s43}]]'),
    ('dynatrace-api-token', '[[dt0c01.{l24}.{l64}]]'),
    ('easypost-api-token', '[[EZAK{l54}]]'),
    ('easypost-test-api-token', '[[EZTK{l54}]]'),
    ('ebay-client-id', '[[{s24}-{s24}-PRD-{h10}-{h10}]]'),
    ('ebay-client-secret', 'export EBAY_CLIENT_SECRET=[[PRD-{h8}-{h4}-{h4}-{h4}-{h8}]]'),
    ('elastic-cloud-api-key', 'EC_API_KEY=[[essu_{s100}]]'),
    ('elevenlabs-api-key', 'export ELEVENLABS_API_KEY=[[sk_{h48}]]'),
    ('endorlabs-api-key', 'export ENDORLABS_API_KEY=[[endr+{a16}]]'),
    ('endorlabs-api-secret', 'export ENDORLABS_API_SECRET=[[endr+{a16}]]'),
    ('etsy-open-api-key', 'export ETSY_OPEN_API_KEY=[[{l24}:{l37}]]'),
    ('exoscale-api-key', '[[EXO{a27}]]'),
    ('exoscale-api-secret', 'export EXOSCALE_API_SECRET=[[{s50}]]'),
    ('facebook-access-token', 'graph api: access_token=[[{d15}|{s32}]]'),
    ('facebook-page-access-token', 'graph api page token [[EAAC{a120}]]'),
    ('facebook-secret', 'export FACEBOOK_SECRET=[[{h32}]]'),
    ('fal-api-key.1', 'export FAL_API_KEY=[[{h8}-{h4}-{h4}-{h4}-{h12}:{h32}]]'),
    ('fastly-api-token', 'export FASTLY_API_TOKEN=[[{l32}]]'),
    ('figma-personal-access-header-token', 'X-Figma-Token: [[{H4}-{H8}-{H4}-{H4}-{H4}-{H12}]]'),
    ('figma-personal-access-token', '[[figd_{u40}]]'),
    ('finicity-api-token', 'export FINICITY_API_TOKEN=[[{h32}]]'),
    ('finicity-client-secret', 'export FINICITY_CLIENT_SECRET=[[{l20}]]'),
    ('finnhub-access-token', 'export FINNHUB_ACCESS_TOKEN=[[{l20}]]'),
    ('flickr-access-token', 'export FLICKR_ACCESS_TOKEN=[[{l32}]]'),
    ('flutterwave-encryption-key', '[[FLWSECK_TEST-{h12}]]'),
    ('flutterwave-public-key', '[[FLWPUBK_TEST-{h32}-X]]'),
    ('flutterwave-secret-key', '[[FLWSECK_TEST-{h32}-X]]'),
    ('flyio-access-token', '[[FlyV1 {s100}]]'),
    ('frameio-api-token', '[[fio-u-{l64}]]'),
    ('freemius-secret-key', "'secret_key' => '[[sk_{s29}]]',"),
    ('freshbooks-access-token', 'export FRESHBOOKS_ACCESS_TOKEN=[[{l64}]]'),
    ('fullstory-api-key', 'FULLSTORY_API_KEY=[[na1.{a40}]]'),
    ('gcp-api-key', '[[AIza{s35}]]'),
    ('gcp-application-default-credentials', '{"client_id": "7648.apps.googleusercontent.com", "client_secret": "[[d-{s24}]]", "refresh_token": "[[1//0{s70}]]", "type": "authorized_user"}'),
    ('gcp-gemini-api', '[[AQ.Ab8RN6{s44}]]'),
    ('gcp-service-account', 'SERVICE_ACCOUNT'),
    ('generic-credential-uri', 'sqlalchemy.exc.OperationalError: connect to postgresql://billing:[[{a16}]]@db.internal:5432/billing failed'),
    ('gitea-access-token', 'export GITEA_ACCESS_TOKEN=[[{h40}]]'),
    ('github-app-token', 'git credential: [[ghs_{a36}]]'),
    ('github-fine-grained-pat', 'GH_TOKEN=[[github_pat_{a22}_{a59}]]'),
    ('github-oauth', '[[gho_{a36}]]'),
    ('github-pat', '[[ghp_{a36}]]'),
    ('github-refresh-token', '[[ghr_{a36}]]'),
    ('gitlab-cicd-job-token', '[[glcbt-{a3}_{s20}]]'),
    ('gitlab-deploy-token', '[[gldt-{s20}]]'),
    ('gitlab-feature-flag-client-token', '[[glffct-{s20}]]'),
    ('gitlab-feed-token', '[[glft-{s20}]]'),
    ('gitlab-incoming-mail-address-token', 'reply to incoming+acme-app-42-[[{l25}]]-issue@gitlab.example.com'),
    ('gitlab-incoming-mail-token', '[[glimt-{s25}]]'),
    ('gitlab-kubernetes-agent-token', '[[glagent-{s50}]]'),
    ('gitlab-oauth-app-secret', '[[gloas-{s64}]]'),
    ('gitlab-pat', '[[glpat-{s20}]]'),
    ('gitlab-pat-routable', '[[glpat-{s163}.{l2}{l7}]]'),
    ('gitlab-pat-routable-versioned', '[[glpat-{s163}.{l2}.{l9}]]'),
    ('gitlab-ptt', '[[glptt-{h40}]]'),
    ('gitlab-rrt', '[[GR1348941{s20}]]'),
    ('gitlab-runner-authentication-token', '[[glrt-{s20}]]'),
    ('gitlab-runner-authentication-token-routable', 'runner registered: [[glrt-t1_{s40}.{l2}{l7}]]'),
    ('gitlab-scim-token', '[[glsoat-{s20}]]'),
    ('gitlab-session-cookie', '[[_gitlab_session={l32}]]'),
    ('gitter-access-token', 'export GITTER_ACCESS_TOKEN=[[{l40}]]'),
    ('gocardless-api-token', 'export GOCARDLESS_API_TOKEN=[[live_{l40}]]'),
    ('grafana-api-key', 'GF_API_KEY=[[eyJrIjoi{b80}]]'),
    ('grafana-cloud-api-token', 'GRAFANA_CLOUD_TOKEN=[[glc_{b80}]]'),
    ('grafana-service-account-token', '[[glsa_{a32}_{h8}]]'),
    ('greptile-api-key', 'export GREPTILE_API_KEY=[[{b48}]]'),
    ('groq-api-key', '[[gsk_{u52}]]'),
    ('gumroad-access-token', 'GUMROAD_ACCESS_TOKEN=[[{h64}]]'),
    ('harness-api-key', 'x-api-key: [[pat.{s22}.{h24}.{a20}]]'),
    ('hashicorp-tf-api-token', '[[{l14}.atlasv1.{l65}]]'),
    ('hashicorp-tf-password', 'export HASHICORP_TF_PASSWORD=[["{l14}"]]'),
    ('heroku-api-key', 'export HEROKU_API_KEY=[[{h8}-{h4}-{h4}-{h4}-{h12}]]'),
    ('heroku-api-key-v2', '[[HRKU-AA{s58}]]'),
    ('highnote-secret-live-key', 'HIGHNOTE_API_KEY=[[sk_live_a2V5Xz{b69}]]'),
    ('honeycomb-api-key', 'HONEYCOMB_API_KEY=[[{h32}]]'),
    ('hubspot-api-key', 'export HUBSPOT_API_KEY=[[{H8}-{H4}-{H4}-{H4}-{H12}]]'),
    ('huggingface-access-token', 'HF_TOKEN=[[hf_{A34}]]'),
    ('huggingface-organization-api-token', 'hub: [[api_org_{A34}]]'),
    ('hunter-api-key.1', 'export HUNTER_API_KEY=[[{h40}]]'),
    ('ibm-cloud-user-api-key', 'export IBM_CLOUD_USER_API_KEY=[[{l43}]]'),
    ('influxdb-api-token', 'INFLUXDB_TOKEN=[[{s88}==]]'),
    ('infomaniak-api-token', 'export INFOMANIAK_API_TOKEN=[[{s80}]]'),
    ('infracost-api-token', '[[ico-{a32}]]'),
    ('instantly-api-key.1', 'export INSTANTLY_API_KEY=[[{b66}==]]'),
    ('intercom-api-key', 'export INTERCOM_API_KEY=[[{l60}]]'),
    ('intra42-client-secret', 'FT_SECRET=[[s-s4t2ud-{h64}]]'),
    ('ionic-personal-access-token', '[[ion_{a42}]]'),
    ('jumpcloud-api-key', 'export JUMPCLOUD_API_KEY=[[{l40}]]'),
    ('jwt', 'Authorization: Bearer [[eyJ{s36}.eyJ{s80}.{s43}]]'),
    ('jwt-base64', 'auth blob [[ZXlKaGJHY2lPaUpJVXpJMU5pSjkuZXlKemRXSWlPaUl4TWpNME5UWTNPRGt3SW4wLn{b60}]]'),
    ('kagi-api-key', 'export KAGI_API_KEY=[[{l11}.{l43}]]'),
    ('kimi-api-key', 'MOONSHOT_API_KEY=[[sk-{s48}]]'),
    ('klaviyo-api-key', 'export KLAVIYO_API_KEY=[[pk_{l34}]]'),
    ('kraken-access-token', 'export KRAKEN_ACCESS_TOKEN=[[{l85}]]'),
    ('kubernetes-secret-yaml', 'K8S_SECRET'),
    ('kucoin-access-token', 'export KUCOIN_ACCESS_TOKEN=[[{h24}]]'),
    ('kucoin-secret-key', 'export KUCOIN_SECRET_KEY=[[{h8}-{h4}-{h4}-{h4}-{h12}]]'),
    ('langchain-langsmith-personal-access-token', '[[lsv2_pt_{h32}_{h10}]]'),
    ('langchain-langsmith-service-key', '[[lsv2_sk_{h32}_{h10}]]'),
    ('langfuse-public-key.1', '[[pk-lf-{h8}-{h4}-{h4}-{h4}-{h12}]]'),
    ('langfuse-secret-key.1', '[[sk-lf-{h8}-{h4}-{h4}-{h4}-{h12}]]'),
    ('lark-app-id', '[[cli_{a16}]]'),
    ('lark-app-secret', 'export LARK_APP_SECRET=[[{a32}]]'),
    ('launchdarkly-access-token', 'export LAUNCHDARKLY_ACCESS_TOKEN=[[{l40}]]'),
    ('lichess-personal-access-token', '[[lip_{a38}]]'),
    ('lighton-paradigm-api-key', 'export LIGHTON_PARADIGM_API_KEY=[[{s60}]]'),
    ('linear-api-key', '[[lin_api_{l40}]]'),
    ('linear-client-secret', 'export LINEAR_CLIENT_SECRET=[[{h32}]]'),
    ('linkedin-client-id', 'export LINKEDIN_CLIENT_ID=[[{l14}]]'),
    ('linkedin-client-secret', 'export LINKEDIN_CLIENT_SECRET=[[{l16}]]'),
    ('llama-cloud-api-key.1', '[[llx-{a48}]]'),
    ('lob-api-key', 'LOB_API_KEY=[[live_{h35}]]'),
    ('lob-pub-api-key', 'LOB_PUB_KEY=[[live_pub_{h31}]]'),
    ('looker-client-id', 'export LOOKER_CLIENT_ID=[[{l20}]]'),
    ('looker-client-secret', 'export LOOKER_CLIENT_SECRET=[[{l24}]]'),
    ('mailchimp-api-key', 'MAILCHIMP_API_KEY=[[{h32}-us21]]'),
    ('mailersend-api-token', '[[mlsn.{a65}]]'),
    ('mailgun-private-api-token', 'export MAILGUN_PRIVATE_API_TOKEN=[[key-{h32}]]'),
    ('mailgun-pub-key', 'export MAILGUN_PUB_KEY=[[pubkey-{h32}]]'),
    ('mailgun-signing-key', 'export MAILGUN_SIGNING_KEY=[[{h32}-{h8}-{h8}]]'),
    ('mapbox-api-token', 'export MAPBOX_API_TOKEN=[[pk.{l60}.{l22}]]'),
    ('mattermost-access-token', 'export MATTERMOST_ACCESS_TOKEN=[[{l26}]]'),
    ('maxmind-license-key', '[[{a6}_{a29}_mmk]]'),
    ('mem0-api-key.1', 'export MEM0_API_KEY=[[m0-{a34}]]'),
    ('mercury-production-api-token', '[[mercury_production_{L4}_{a45}_yrucrem]]'),
    ('mergify-application-key', '[[mergify_application_key_{s120}]]'),
    ('messagebird-api-token', 'export MESSAGEBIRD_API_TOKEN=[[{l25}]]'),
    ('messagebird-client-id', 'export MESSAGEBIRD_CLIENT_ID=[[{h8}-{h4}-{h4}-{h4}-{h12}]]'),
    ('microsoft-teams-webhook', 'POST [[https://acme.webhook.office.com/webhookb2/{l8}-{l4}-{l4}-{l4}-{l12}@{l8}-{l4}-{l4}-{l4}-{l12}/IncomingWebhook/{l32}/{l8}]] 400'),
    ('midtrans-production-server-client-key', 'MIDTRANS_SERVER_KEY=[[Mid-server-{s16}]]'),
    ('minimax-api-key', '[[sk-api-{s119}]]'),
    ('miro-access-token', '[[eyJtaXJv{a37}_{s42}]]'),
    ('miro-client-id', 'export MIRO_CLIENT_ID=[[{d18}]]'),
    ('miro-client-secret', 'export MIRO_CLIENT_SECRET=[[{l32}]]'),
    ('mistral-api-key', 'export MISTRAL_API_KEY=[[{u32}]]'),
    ('monday-api-token.1', 'export MONDAY_API_TOKEN=[[eyJ{s105}.eyJ{s525}.{s260}]]'),
    ('mongodb-atlas-service-account-id', '[[mdb_sa_id_{h24}]]'),
    ('mongodb-atlas-service-account-secret', '[[mdb_sa_sk_{s40}]]'),
    ('mongodb-connection-string', 'MongoServerError: bad auth for [[mongodb+srv://app:{a16}@cluster0.ab1cd.mongodb.net/prod]]'),
    ('mux-access-token-id.1', 'export MUX_ACCESS_TOKEN_ID=[[{h8}-{h4}-{h4}-{h4}-{h12}]]'),
    ('mux-access-token-secret.1', 'export MUX_ACCESS_TOKEN_SECRET=[[{b75}]]'),
    ('neon-api-key', '[[napi_{a64}]]'),
    ('netlify-access-token', 'export NETLIFY_ACCESS_TOKEN=[[{l43}]]'),
    ('new-relic-browser-api-token', 'export NEW_RELIC_BROWSER_API_TOKEN=[[NRJS-{h19}]]'),
    ('new-relic-insert-key', 'export NEW_RELIC_INSERT_KEY=[[NRII-{l32}]]'),
    ('new-relic-user-api-id', 'export NEW_RELIC_USER_API_ID=[[{l64}]]'),
    ('new-relic-user-api-key', 'export NEW_RELIC_USER_API_KEY=[[NRAK-{l27}]]'),
    ('ngrok-api-key.1', 'export NGROK_API_KEY=[[2{a26}_{d1}{a20}]]'),
    ('notion-api-token', '[[ntn_{d11}{a32}{a3}]]'),
    ('npm-access-token', '[[npm_{l36}]]'),
    ('nuget-config-password', '<add key="ClearTextPassword" value="[[{a20}]]" />'),
    ('nvidia-api-key', '[[nvapi-{u65}]]'),
    ('nylas-api-key.1', '[[nyk_{a67}]]'),
    ('nytimes-access-token', 'export NYTIMES_ACCESS_TOKEN=[[{l32}]]'),
    ('octopus-deploy-api-key', '[[API-{u26}]]'),
    ('okta-access-token', 'export OKTA_ACCESS_TOKEN=[[00{s40}]]'),
    ('ollama-api-key', 'export OLLAMA_API_KEY=[[{h32}.{s24}]]'),
    ('onesignal-rich-authentication-token', 'ONESIGNAL_REST_API_KEY=[[os_v2_app_{t103}]]'),
    ('onfido-live-api-token-ca', '[[api_live_ca.{s50}]]'),
    ('onfido-live-api-token-eu', '[[api_live.{s50}]]'),
    ('onfido-live-api-token-us', '[[api_live_us.{s50}]]'),
    ('openai-api-key', 'openai.AuthenticationError: Incorrect API key provided: [[sk-proj-{s74}T3BlbkFJ{s74}]]'),
    ('openrouter-api-key', '[[sk-or-v1-{h64}]]'),
    ('openshift-user-token', '[[sha256~{s43}]]'),
    ('openweather-api-key', 'export OPENWEATHER_API_KEY=[[{l32}]]'),
    ('opsgenie-api-key.1', 'export OPSGENIE_API_KEY=[[{h8}-{h4}-{h4}-{h4}-{h12}]]'),
    ('ovh-application-key', 'export OVH_APPLICATION_KEY=[[{a16}]]'),
    ('ovh-application-secret', 'export OVH_APPLICATION_SECRET=[[{a32}]]'),
    ('ovh-consumer-key', 'export OVH_CONSUMER_KEY=[[{a32}]]'),
    ('paddle-live-api-key', '[[pdl_live_apikey_{l26}_{a22}_{a3}]]'),
    ('pagerduty-authorization-token.1', 'export PAGERDUTY_AUTHORIZATION_TOKEN=[[u+{s18}]]'),
    ('paypal-client-id.1', 'export PAYPAL_CLIENT_ID=[[A{s88}]]'),
    ('paypal-client-secret.1', 'export PAYPAL_CLIENT_SECRET=[[{s99}]]'),
    ('perplexity-api-key', '[[pplx-{a48}]]'),
    ('persona-production-api-key', '[[persona_production_{l50}]]'),
    ('pinecone-api-key.1', 'export PINECONE_API_KEY=[[{h8}-{h4}-{h4}-{h4}-{h12}]]'),
    ('pinecone-api-key.2', '[[pcsk_{a5}_{a63}]]'),
    ('pinterest-access-token', '[[pina_{s110}]]'),
    ('plaid-api-token', 'PLAID_ACCESS_TOKEN=[[access-production-{h8}-{h4}-{h4}-{h4}-{h12}]]'),
    ('plaid-client-id', 'export PLAID_CLIENT_ID=[[{l24}]]'),
    ('plaid-secret-key', 'export PLAID_SECRET_KEY=[[{l30}]]'),
    ('planetscale-api-token', '[[pscale_tkn_{s48}]]'),
    ('planetscale-id', 'PLANETSCALE_USER=[[{l12}]]'),
    ('planetscale-oauth-token', '[[pscale_oauth_{s48}]]'),
    ('planetscale-password', '[[pscale_pw_{s48}]]'),
    ('plivo-auth-id', 'export PLIVO_AUTH_ID=[[MA{u18}]]'),
    ('plivo-auth-token', 'export PLIVO_AUTH_TOKEN=[[{s40}]]'),
    ('polar-oauth-access-token', '[[polar_at_{s60}]]'),
    ('polar-organization-access-token', '[[polar_oat_{s60}]]'),
    ('polar-personal-access-token', '[[polar_pat_{s60}]]'),
    ('polymarket-address', 'export POLYMARKET_ADDRESS=[[0x{h40}]]'),
    ('polymarket-api-key', 'export POLYMARKET_API_KEY=[[{h8}-{h4}-{h4}-{h4}-{h12}]]'),
    ('polymarket-api-secret', 'POLY_API_SECRET=[[{b44}]]'),
    ('polymarket-passphrase', 'export POLYMARKET_PASSPHRASE=[[{a68}]]'),
    ('polymarket-private-key', 'export POLYMARKET_PRIVATE_KEY=[[0x{h64}]]'),
    ('posthog-personal-api-key', '[[phx_{s45}]]'),
    ('posthog-project-api-key', '[[phc_{s42}]]'),
    ('postman-api-token', '[[PMAK-{h24}-{h34}]]'),
    ('postmark-api-token.1', 'export POSTMARK_API_TOKEN=[[{h8}-{h4}-{h4}-{h4}-{h12}]]'),
    ('prefect-api-token', '[[pnu_{a36}]]'),
    ('private-key', 'PRIVATE_KEY'),
    ('privateai-api-token', 'export PRIVATEAI_API_TOKEN=[[{l32}]]'),
    ('proof-full-access-api-key', 'PROOF_API_KEY=[[prf_{s40}]]'),
    ('pulumi-api-token', '[[pul-{h40}]]'),
    ('pypi-upload-token', '[[pypi-AgEIcHlwaS5vcmc{s525}]]'),
    ('rainforest-pay-production-api-key', 'export RAINFOREST_PAY_PRODUCTION_API_KEY=[[apikey_{h64}]]'),
    ('ramp-client-id', '[[ramp_id_{a40}]]'),
    ('ramp-client-secret', '[[ramp_sec_{a48}]]'),
    ('rapidapi-access-token', 'export RAPIDAPI_ACCESS_TOKEN=[[{l50}]]'),
    ('razorpay-key-id.1', 'razorpay: [[rzp_live_{a14}]]'),
    ('razorpay-key-secret.1', 'export RAZORPAY_KEY_SECRET=[[{a24}]]'),
    ('readme-api-token', '[[rdme_{l70}]]'),
    ('redirect-pizza-api-token.1', '[[rpa_{a30}]]'),
    ('render-api-key', '[[rnd_{a28}]]'),
    ('replicate-api-token', '[[r8_{a37}]]'),
    ('resend-api-key.1', 'RESEND_API_KEY=[[re_{m8}_{m24}]]'),
    ('retell-api-key.1', 'export RETELL_API_KEY=[[key_{h28}]]'),
    ('rootly-api-key.1', '[[rootly_{h64}]]'),
    ('rubygems-api-token', '[[rubygems_{h48}]]'),
    ('runpod-api-key.1', '[[rpa_{u40}{a6}]]'),
    ('salesforce-access-token.1', '[[00{a13}!{s170}]]'),
    ('salesforce-instance-url.1', 'instance_url https://[[acme-{l6}.my.salesforce.com]]'),
    ('samsara-api-token.1', '[[samsara_api_{a29}]]'),
    ('scaleway-secret-key', 'export SCALEWAY_SECRET_KEY=[[{h8}-{h4}-{h4}-{h4}-{h12}]]'),
    ('scalingo-api-token', '[[tk-us-{s48}]]'),
    ('scalr-api-access-token.1', 'export SCALR_API_ACCESS_TOKEN=[[eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9.eyJpc3MiOiJ1c2VyIiwianRpIjoiYXQt{s30}.{s43}]]'),
    ('segment-public-api-token.1', '[[sgp_{a64}]]'),
    ('sendbird-access-id', 'export SENDBIRD_ACCESS_ID=[[{h8}-{h4}-{h4}-{h4}-{h12}]]'),
    ('sendbird-access-token', 'export SENDBIRD_ACCESS_TOKEN=[[{h40}]]'),
    ('sendgrid-api-token', '[[SG.{s22}.{s43}]]'),
    ('sendinblue-api-token', '[[xkeysib-{h64}-{a16}]]'),
    ('sentry-access-token', 'export SENTRY_ACCESS_TOKEN=[[{h64}]]'),
    ('sentry-org-token', 'SENTRY_AUTH_TOKEN=[[sntrys_eyJpYXQiO{a40}LCJyZWdpb25fdXJs{a40}_{b43}]]'),
    ('sentry-user-token', '[[sntryu_{h64}]]'),
    ('settlemint-application-access-token', '[[sm_aat_{a16}]]'),
    ('settlemint-personal-access-token', '[[sm_pat_{a16}]]'),
    ('settlemint-service-access-token', '[[sm_sat_{a16}]]'),
    ('shippo-api-token', 'SHIPPO_TOKEN=[[shippo_live_{h40}]]'),
    ('shopify-access-token', '[[shpat_{h32}]]'),
    ('shopify-custom-access-token', '[[shpca_{h32}]]'),
    ('shopify-private-app-access-token', '[[shppa_{h32}]]'),
    ('shopify-shared-secret', '[[shpss_{h32}]]'),
    ('sidekiq-secret', 'export SIDEKIQ_SECRET=[[{h8}:{h8}]]'),
    ('sidekiq-sensitive-url', 'bundle: fetching [[https://{h8}:{h8}@gems.contribsys.com/]]'),
    ('slack-app-token', 'SLACK_APP_TOKEN=[[xapp-1-A{u10}-{d13}-{h64}]]'),
    ('slack-bot-token', '[[xoxb-{d11}-{d11}{a24}]]'),
    ('slack-config-access-token', 'slack: [[xoxe.xoxp-1-{a164}]]'),
    ('slack-config-refresh-token', 'slack: [[xoxe-1-{a146}]]'),
    ('slack-legacy-bot-token', '[[xoxb-{d11}-{a22}]]'),
    ('slack-legacy-token', 'slack: [[xoxs-{d10}-{d10}-{d10}-{h64}]]'),
    ('slack-legacy-workspace-token', 'slack: [[xoxa-2-{a40}]]'),
    ('slack-session-cookie', 'Cookie: d=[[xoxd-{s120}]]'),
    ('slack-session-token', 'slack: [[xoxc-{d11}-{d12}-{d12}-{h64}]]'),
    ('slack-user-token', 'SLACK_USER_TOKEN=[[xoxp-{d11}-{d11}-{d12}-{a32}]]'),
    ('slack-webhook-url', 'webhook [[https://hooks.slack.com/services/T{u8}/B{u10}/{a24}]] returned 404'),
    ('snowflake-account-host.1', 'connecting to [[acme-{l7}.snowflakecomputing.com]]'),
    ('snowflake-programmatic-access-token.1', 'export SNOWFLAKE_PROGRAMMATIC_ACCESS_TOKEN=[[{s300}]]'),
    ('snyk-api-token', 'export SNYK_API_TOKEN=[[{h8}-{h4}-{h4}-{h4}-{h12}]]'),
    ('sonar-api-token', 'SONAR_TOKEN=[[squ_{h40}]]'),
    ('sourcegraph-access-token', 'SRC_ACCESS_TOKEN=[[sgp_{h16}_{h40}]]'),
    ('square-access-token', 'SQUARE_ACCESS_TOKEN=[[EAAA{s60}]]'),
    ('squarespace-access-token', 'export SQUARESPACE_ACCESS_TOKEN=[[{h8}-{h4}-{h4}-{h4}-{h12}]]'),
    ('sslmate-api-key.1', 'export SSLMATE_API_KEY=[[{a36}]]'),
    ('stability-ai-api-key', 'export STABILITY_AI_API_KEY=[[sk-{a48}]]'),
    ('stripe-access-token', "stripe.api_key = '[[sk_live_{a24}]]'"),
    ('sumologic-access-id', 'export SUMOLOGIC_ACCESS_ID=[[su{a12}]]'),
    ('sumologic-access-token', 'export SUMOLOGIC_ACCESS_TOKEN=[[{l64}]]'),
    ('supabase-management-token', '[[sbp_{l40}]]'),
    ('supabase-project-api-key', '[[sb_secret_{s31}]]'),
    ('supabase-project-url', '[[https://{l24}.supabase.co]]'),
    ('tableau-personal-access-token-name.1', 'export TABLEAU_PERSONAL_ACCESS_TOKEN_NAME=[[{A1}{s26}]]'),
    ('tableau-personal-access-token.1', 'TABLEAU_PAT=[[{b22}==:{a32}]]'),
    ('tableau-server-host.1', '[[{l24}.online.tableau.com]]'),
    ('tailscale-api-key.1', '[[tskey-api-{s28}]]'),
    ('telegram-bot-api-token', 'export TELEGRAM_BOT_API_TOKEN=[[{d10}:A{l34}]]'),
    ('telnyx-api-v2-key.1', 'export TELNYX_API_V2_KEY=[[KEY{s55}]]'),
    ('temporal-cloud-api-key.1', 'TEMPORAL_API_KEY=[[eyJ{s20}.{s8}Y2NvdW50X2lk{s8}InRlbXBvcmFsLmlv{s8}a2V5X2lk{s30}.{s43}]]'),
    ('thunderstore-api-token.1', '[[tss_{s50}]]'),
    ('togetherai-api-key', '[[tgp_v1_{s43}]]'),
    ('travisci-access-token', 'export TRAVISCI_ACCESS_TOKEN=[[{l22}]]'),
    ('twilio-api-key', '[[SK{h32}]]'),
    ('twitch-api-token', 'export TWITCH_API_TOKEN=[[{l30}]]'),
    ('twitter-access-secret', 'export TWITTER_ACCESS_SECRET=[[{l45}]]'),
    ('twitter-access-token', 'export TWITTER_ACCESS_TOKEN=[[{d20}-{a30}]]'),
    ('twitter-api-key', 'export TWITTER_API_KEY=[[{l25}]]'),
    ('twitter-api-secret', 'export TWITTER_API_SECRET=[[{l50}]]'),
    ('twitter-bearer-token', 'TWITTER_BEARER_TOKEN=[[AAAAAAAAAAAAAAAAAAAAA{a90}]]'),
    ('typeform-api-token', 'export TYPEFORM_API_TOKEN=[[tfp_{l59}]]'),
    ('unkey-root-key.1', '[[unkey_{a26}]]'),
    ('upcloud-api-token', '[[ucat_{a28}]]'),
    ('upstage-api-key', 'export UPSTAGE_API_KEY=[[{a45}]]'),
    ('upstash-redis-rest-token.1', 'UPSTASH_REDIS_REST_TOKEN=[[AYNgAS{s60}]]'),
    ('upstash-redis-rest-url.1', '[[https://{l1}{l32}.upstash.io]]'),
    ('val-town-api-token.1', '[[vtwn_{s50}]]'),
    ('vault-batch-token', '[[hvb.{s219}]]'),
    ('vault-service-token', 'VAULT_TOKEN=[[hvs.{s100}]]'),
    ('vercel-ai-gateway-key', '[[vck_{s56}]]'),
    ('vercel-api-token', 'export VERCEL_API_TOKEN=[[{u24}]]'),
    ('vercel-app-access-token', '[[vca_{s56}]]'),
    ('vercel-app-refresh-token', '[[vcr_{s56}]]'),
    ('vercel-integration-token', '[[vci_{s56}]]'),
    ('vercel-personal-access-token', '[[vcp_{s56}]]'),
    ('virustotal-api-key.1', 'export VIRUSTOTAL_API_KEY=[[{h64}]]'),
    ('voyageai-api-key', 'VOYAGE_API_KEY=[[pa-{s43}]]'),
    ('vultr-api-key.1', 'export VULTR_API_KEY=[[{h36}]]'),
    ('wakatime-api-key.1', 'export WAKATIME_API_KEY=[[{h8}-{h4}-{h4}-{h4}-{h12}]]'),
    ('wakatime-api-key.2', '[[waka_{l50}]]'),
    ('weatherstack-api-key.1', 'export WEATHERSTACK_API_KEY=[[{l32}]]'),
    ('weights-and-biases-api-key', 'export WEIGHTS_AND_BIASES_API_KEY=[[{h40}]]'),
    ('weights-and-biases-api-key-v1', '[[wandb_v1_{a77}]]'),
    ('wiz-client-id.1', 'export WIZ_CLIENT_ID=[[{a54}]]'),
    ('wiz-client-secret.1', 'export WIZ_CLIENT_SECRET=[[{a64}]]'),
    ('woocommerce-consumer-secret.1', 'export WOOCOMMERCE_CONSUMER_SECRET=[[cs_{h40}]]'),
    ('workato-developer-api-token.1', 'WORKATO_TOKEN=[[wrkaus-eyJ{s20}.{s30}.{s70}]]'),
    ('workos-production-api-key.1', 'WORKOS_API_KEY=[[sk_live_a2V5Xz{b69}]]'),
    ('xai-api-key', '[[xai-{s95}]]'),
    ('xendit-production-api-key.1', '[[xnd_production_{a64}]]'),
    ('yandex-access-token', 'YANDEX_TOKEN=[[t1.{s40}.{s86}]]'),
    ('yandex-api-key', 'export YANDEX_API_KEY=[[AQVN{s36}]]'),
    ('yandex-aws-access-token', 'export YANDEX_AWS_ACCESS_TOKEN=[[YC{s38}]]'),
    ('zai-api-key', 'ZAI_API_KEY=[[{h32}.{a16}]]'),
    ('zendesk-secret-key', 'export ZENDESK_SECRET_KEY=[[{l40}]]'),
    ('zoho-client-id.1', 'export ZOHO_CLIENT_ID=[[1000.{l30}]]'),
    ('zoho-client-secret.1', 'export ZOHO_CLIENT_SECRET=[[{h42}]]'),
    ('zoho-oauth-token.1', 'export ZOHO_OAUTH_TOKEN=[[1000.{h32}.{h32}]]'),
    ('zoho-zapi-key.1', 'ZOHO_ZAPI_KEY=[[1001.{h32}.{h32}]]'),
    ('zuplo-consumer-api-key.1', '[[zpka_{l32}_{h8}]]'),
    ('secrets/bitbucketcredentials', 'git clone [[https://deploy:{a20}@bitbucket.org/acme/app.git]]'),
    ('secrets/bitwardenoauth2access', '{"user_{h8}-{h4}-{h4}-{h4}-{h12}_token_apiKeyClientSecret": "[[{a30}]]"}'),
    ('secrets/circleciproject', '[[CCIPRJ_{a22}_{h40}]]'),
    ('secrets/cloudflareapitoken', 'CLOUDFLARE_API_TOKEN=[[{s40}]]'),
    ('secrets/codecatalystcredentials', 'git clone [[https://deploy:{a20}@git.us-west-2.codecatalyst.aws/v1/acme/app/repo]]'),
    ('secrets/codecommitcredentials', 'git clone [[https://deploy-at-1234:{b44}@git-codecommit.us-east-1.amazonaws.com/v1/repos/app]]'),
    ('secrets/denopatorg', '[[ddo_{a36}]]'),
    ('secrets/digitaloceanapikey', '[[dop_v1_{h64}]]'),
    ('secrets/grokxaiapikey', '[[xai-{a80}]]'),
    ('secrets/hcpclientcredentials', 'HCP_CLIENT_SECRET=[[{s64}]]'),
    ('secrets/hcpclientcredentials-client-id', 'HCP_CLIENT_ID=[[{a32}]]'),
    ('secrets/herokuplatformkey', '[[HRKU-{s60}]]'),
    ('secrets/npmjsaccesstoken', '[[npm_{a36}]]'),
    ('secrets/openrouter', '[[sk-or-v{d24}-{s20}]]'),
    ('secrets/packagistorgreadtoken', '[[packagist_ort_{h68}]]'),
    ('secrets/packagistorgreadtoken-repository', 'composer: repository [[https://repo.packagist.com/acme/]]'),
    ('secrets/packagistorgupdatetoken', '[[packagist_out_{h68}]]'),
    ('secrets/packagistorgupdatetoken-repository', 'composer: repository [[https://repo.packagist.com/acme/]]'),
    ('secrets/packagistsecret', '[[packagist_acs_{h80}]]'),
    ('secrets/packagistsecret-api-key', '[[packagist_ack_{h30}]]'),
    ('secrets/postmanapikey', '[[PMAK-{h24}-{h34}]]'),
    ('secrets/postmancollectiontoken', '[[PMAT-{a26}]]'),
    ('secrets/sendgrid', '[[SG.{s22}.{s43}]]'),
    ('secrets/slackappconfigaccesstoken', 'slack: [[xoxe.xoxp-1-{a166}]]'),
    ('secrets/slackappconfigrefreshtoken', 'slack: [[xoxe-1-{a147}]]'),
    ('secrets/slackappleveltoken', 'SLACK_APP_TOKEN=[[xapp-1-{a11}-{d13}-{h64}]]'),
    # gitleaks' catch-all, and the forms issue 11 names that the catalogues lack.
    ('generic-api-key', 'config: {"api_key": "[[{a32}]]", "region": "eu-west-1"}'),
    ('putty-private-key', 'PUTTY_KEY'),
    ('docker-config-auth', '{"auths": {"registry.acme.io": {"auth": "[[DOCKER_AUTH]]"}}}'),
    ('azure-sas-signature', 'GET https://acme.blob.core.windows.net/c/x.tar?sv=2022-11-02&se=2026-12-01T00%3A00%3A00Z&sp=r&sig=[[{b43}%3D]] 403'),
    ('netrc-password', 'machine api.acme.io login deploy password [[{l12}]]'),
    ('pgpass-line', 'db.internal:5432:billing:billing:[[{a14}]]'),
]

# Families that name something other than a credential: host names, URLs, account or
# client identifiers and usernames. They are not redacted by design (they are what makes
# an error message useful, and none grants access alone); see README, Redaction.
NOT_SECRETS: dict[str, str] = {
    f: "identifier or address, not a credential" for f in (
        "adobe-client-id", "algolia-application-id", "artifactory-jfrog-url",
        "asana-client-id", "auth0-domain.1", "azure-client-id", "azure-storage-account-name",
        "azure-tenant-id", "bitbucket-client-id", "browserstack-username.1", "canva-client-id",
        "clickhouse-cloud-key-id", "cloudflare-account-id.1", "cloudinary-cloud-name",
        "discord-client-id", "ebay-client-id", "linkedin-client-id", "looker-client-id",
        "messagebird-client-id", "miro-client-id", "mongodb-atlas-service-account-id",
        "mux-access-token-id.1", "new-relic-user-api-id", "planetscale-id", "plivo-auth-id",
        "polymarket-address", "ramp-client-id", "salesforce-instance-url.1",
        "secrets/packagistorgreadtoken-repository", "secrets/packagistorgupdatetoken-repository",
        "secrets/hcpclientcredentials-client-id", "sendbird-access-id",
        "snowflake-account-host.1", "sumologic-access-id", "supabase-project-url",
        "tableau-personal-access-token-name.1", "tableau-server-host.1",
        "upstash-redis-rest-url.1", "wiz-client-id.1", "zoho-client-id.1", "plaid-client-id",
        "lark-app-id", "aikido-client-id", "langfuse-public-key.1", "lob-pub-api-key",
        "mailgun-pub-key", "flutterwave-public-key", "posthog-project-api-key",
        "devcycle-client-sdk-key", "devcycle-mobile-sdk-key", "new-relic-browser-api-token",
        "gitlab-incoming-mail-address-token", "auth0-client-id.1", "paypal-client-id.1",
    )
}

_NEUTRAL = (
    "2026-11-30T21:14:03Z ERROR upstream rejected credential {} (401 Unauthorized)",
    "+ deploy --target prod --using {} --dry-run",
    'warning: found "{}" in build output',
    '{{"ts": 1764537243, "level": "warn", "msg": "retrying", "value": "{}"}}',
    "ValueError: malformed input {} at line 3",
    "    client.connect(\"{}\")",
)


@dataclass(frozen=True)
class Sample:
    family: str
    line: str
    secrets: tuple[str, ...]
    """Every secret span; none may survive redaction."""
    fragments: tuple[str, ...]
    """Every random field of 8 characters or more: none may survive either (a partial
    redaction that leaves the body of a key is a leak)."""


def _fill(template: str, rng: random.Random) -> tuple[str, list[str]]:
    fields: list[str] = []

    def field(m: re.Match[str]) -> str:
        value = "".join(rng.choice(CLASSES[m.group(1)]) for _ in range(int(m.group(2))))
        fields.append(value)
        return value

    return _FIELD.sub(field, template), fields


def _pem_body(rng: random.Random, n_bytes: int, width: int = 64) -> list[str]:
    raw = base64.b64encode(bytes(rng.getrandbits(8) for _ in range(n_bytes))).decode()
    return [raw[i:i + width] for i in range(0, len(raw), width)]


def private_key_block(rng: random.Random, label: str = "RSA PRIVATE KEY",
                      n_bytes: int = 1190, width: int = 64) -> tuple[str, list[str]]:
    """A PEM-shaped block of random bytes (not a parseable key) and its body lines."""
    body = _pem_body(rng, n_bytes, width)
    return "\n".join([f"-----BEGIN {label}-----", *body, f"-----END {label}-----"]), body


def putty_key(rng: random.Random, private_lines: int = 14) -> tuple[str, list[str]]:
    """A PuTTY v3 key file shape: public lines are public, private lines and MAC are not."""
    public = _pem_body(rng, 270)
    private = _pem_body(rng, private_lines * 48)
    mac = "".join(rng.choice(CLASSES["h"]) for _ in range(64))
    text = "\n".join([
        "PuTTY-User-Key-File-3: ssh-rsa", "Encryption: none", "Comment: deploy@ci",
        f"Public-Lines: {len(public)}", *public, f"Private-Lines: {len(private)}", *private,
        f"Private-MAC: {mac}"])
    return text, [*private, mac]


def _special(family: str, rng: random.Random) -> tuple[str, list[str], list[str]]:
    """Multi-line families: (text, secret spans, fragments)."""
    if family == "private-key":
        block, body = private_key_block(rng)
        return f"wrote deploy key to /tmp/id_rsa:\n{block}\nchmod 600 /tmp/id_rsa", body, body
    if family == "gcp-service-account":
        block, body = private_key_block(rng, "PRIVATE KEY")
        doc = {"type": "service_account", "project_id": "acme-prod",
               "private_key_id": "".join(rng.choice(CLASSES["h"]) for _ in range(40)),
               "private_key": block + "\n", "client_email": "ci@acme-prod.iam.gserviceaccount.com",
               "auth_uri": "https://accounts.google.com/o/oauth2/auth",
               "auth_provider_x509_cert_url": "https://www.googleapis.com/oauth2/v1/certs"}
        return f"loaded credentials: {json.dumps(doc)}", body, body
    if family == "kubernetes-secret-yaml":
        pw = base64.b64encode("".join(rng.choice(CLASSES["a"]) for _ in range(18)).encode())
        token = base64.b64encode(bytes(rng.getrandbits(8) for _ in range(30)))
        values = [pw.decode(), token.decode()]
        text = ("apiVersion: v1\nkind: Secret\nmetadata:\n  name: db-credentials\ntype: Opaque\n"
                f"data:\n  password: {values[0]}\n  api-token: {values[1]}\n")
        return text, values, values
    if family == "putty-private-key":
        text, secret = putty_key(rng)
        return text, secret, secret
    raise KeyError(family)


def build(seed: int = 20261130) -> list[Sample]:
    """Every family's sample, deterministic for a seed."""
    rng = random.Random(seed)
    samples = []
    for i, (family, template) in enumerate(SPECS):
        if template.isupper() and "[[" not in template:  # a named multi-line form
            text, secrets, fragments = _special(family, rng)
            samples.append(Sample(family, text, tuple(secrets), tuple(fragments)))
            continue
        if "DOCKER_AUTH" in template:
            user_pw = f"deploy:{''.join(rng.choice(CLASSES['a']) for _ in range(20))}"
            template = template.replace("DOCKER_AUTH", base64.b64encode(user_pw.encode()).decode())
        if template.startswith("[["):
            template = _NEUTRAL[i % len(_NEUTRAL)].format(template)
        line, fields = _fill(template, rng)
        # Secret spans, located in the filled line by the same markers.
        spans: tuple[str, ...] = tuple(re.findall(r"\[\[(.*?)\]\]", line, re.S))
        line = line.replace("[[", "").replace("]]", "")
        parts = tuple(f for f in fields if len(f) >= 8 and any(f in s for s in spans))
        samples.append(Sample(family, line, spans, parts))
    return samples
