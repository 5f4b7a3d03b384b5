"""localnet/localnet.toml: the committed file, the defaults, and a specific error for each bad setting."""

from __future__ import annotations

from pathlib import Path

import pytest

from planetserve.localnet.config import (
    DEFAULT_FILE,
    ConfigError,
    LocalnetConfig,
    NodeSpec,
    load_config,
    parse_config,
)
from planetserve.registry.params import Params

REPO = Path(__file__).resolve().parent.parent
SOURCE = Path("/somewhere/localnet.toml")


def test_the_committed_file_says_what_the_defaults_are():
    committed = load_config(REPO / DEFAULT_FILE)
    assert committed == LocalnetConfig(source=REPO / DEFAULT_FILE)
    assert committed.validators == 4 and committed.verifiers and committed.relays >= 8
    assert [(n.name, n.model, n.model_id, n.behaviour, n.org_id) for n in committed.nodes] == [
        ("honest-a", "gt", "gt", "honest", "org-honest-a"), ("honest-b", "gt", "gt", "honest", "org-honest-b"),
        ("smaller", "tiny", "gt", "honest", "org-smaller"), ("clickbait", "gt", "gt", "alter-prompts", "org-clickbait")]
    assert (committed.params.epoch_blocks, committed.params.results_blocks) == (40, 16)
    assert committed.preset == "full" and committed.data_dir is None
    assert committed.dashboard_http == ""  # a free port, picked once


def test_a_small_file_overrides_what_it_names(tmp_path):
    config = parse_config("""
[network]
validators = 1
verifiers = false
timeout_commit = "300ms"
keep_heights = 5000
[params]
epoch_blocks = 60
user_ttl_seconds = 120
[models]
preset = "quick"
data_dir = "family"
[[nodes]]
name = "a"
[[nodes]]
name = "b"
model = "small"
org = "shared"
capacity = 4
[relays]
count = 3
proxies = 4
[client]
http = "127.0.0.1:8080"
[dashboard]
http = "127.0.0.1:8090"
""", tmp_path / "x.toml")
    assert config.validators == 1 and not config.verifiers and config.timeout_commit == "300ms"
    assert config.keep_heights == 5000
    assert config.params == Params(epoch_blocks=60, results_blocks=16, vrf_window_blocks=10,
                                   plan_window_blocks=14, probation_epochs=0, user_ttl_seconds=120)
    assert config.preset == "quick" and config.data_dir == tmp_path / "family"
    assert config.family_dir(tmp_path / "root") == tmp_path / "family"
    assert config.nodes == (NodeSpec("a", org="org-a"), NodeSpec("b", model="small", org="shared", capacity=4))
    assert (config.relays, config.proxies, config.client_http) == (3, 4, "127.0.0.1:8080")
    assert config.dashboard_http == "127.0.0.1:8090"
    assert config.prompt == LocalnetConfig().prompt and config.has_client


def test_validators_only():
    config = parse_config("nodes = []\n[network]\nverifiers = false\n[relays]\ncount = 0\n", SOURCE)
    assert not config.nodes and not config.has_client and config.relays == 0
    assert config.family_dir(Path("/r")) == Path("/r")


def test_without_a_file_the_defaults(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert load_config() == LocalnetConfig()
    with pytest.raises(ConfigError, match="cannot read the localnet configuration .*nope.toml"):
        load_config(tmp_path / "nope.toml")


@pytest.mark.parametrize(("text", "message"), [
    ("[network\n", "not valid TOML"),
    ("colour = 1\n", "colour: unknown setting; the file takes client, dashboard, models, network, nodes, params, "
                     "relays"),
    ("[network]\nvalidator = 4\n", "network.validator: unknown setting; network takes chain_id, keep_heights, "
                                   "timeout_commit"),
    ("[network]\nkeep_heights = 1\n", r"network.keep_heights: must be 0 \(keep every height\) or at least 2"),
    ("[network]\nkeep_heights = -1\n", "network.keep_heights: must be an integer from 0 to 1000000000"),
    ("network = 3\n", r"network: must be a table \(\[network\]\)"),
    ("[network]\nvalidators = 0\n", "network.validators: must be an integer from 1 to 16, got 0"),
    ("[network]\nvalidators = \"4\"\n", "network.validators: must be an integer from 1 to 16, got '4'"),
    ("[network]\nvalidators = true\n", "network.validators: must be an integer from 1 to 16, got True"),
    ("[network]\nchain_id = \"a b\"\n", "network.chain_id: must be 1-64 characters"),
    ("[network]\ntimeout_commit = \"1 second\"\n", "network.timeout_commit: must be a duration such as"),
    ("[network]\nverifiers = \"yes\"\n", "network.verifiers: must be true or false, got 'yes'"),
    ("[params]\nepoch_blocks = 10\n", "params.results_blocks: must be less than epoch_blocks, got 16"),
    ("[params]\nepoch_blocks = -1\n", "params.epoch_blocks: must be a positive integer, got -1"),
    ("[params]\nepochs = 3\n", "params.epochs: unknown parameter, got 3"),
    ("params = 1\n", r"params: must be a table \(\[params\]\)"),
    ("[models]\npreset = \"huge\"\n", "models.preset: must be one of full, quick, got 'huge'"),
    ("[models]\ndata_dir = 3\n", "models.data_dir: must be a directory path"),
    ("nodes = 3\n", r"nodes: must be an array of tables \(\[\[nodes\]\]\)"),
    ("[[nodes]]\nmodel = \"gt\"\n", r"nodes\[0\].name: missing"),
    ("[[nodes]]\nname = \"Big Node\"\n", r"nodes\[0\].name: must be 1-32 lower-case letters"),
    ("[[nodes]]\nname = \"a\"\n[[nodes]]\nname = \"a\"\n", r"nodes\[1\].name: 'a' names two nodes"),
    ("[[nodes]]\nname = \"a\"\nmodel = \"llama\"\n", r"nodes\[0\].model: must be one of gt, small, tiny"),
    ("[[nodes]]\nname = \"a\"\nmodel_id = \"x\"\n", r"nodes\[0\].model_id: must be one of gt, small"),
    ("[[nodes]]\nname = \"a\"\nbehaviour = \"evil\"\n",
     r"nodes\[0\].behaviour: must be one of honest, alter-prompts, got 'evil'"),
    ("[[nodes]]\nname = \"a\"\norg = \"a b\"\n", r"nodes\[0\].org: must be 1-64 characters"),
    ("[[nodes]]\nname = \"a\"\ncapacity = 0\n", r"nodes\[0\].capacity: must be an integer from 1 to 64"),
    ("[[nodes]]\nname = \"a\"\ngpu = 1\n", r"nodes\[0\].gpu: unknown setting"),
    ("[relays]\ncount = 2\n", "relays.count: 2 relay.s. cannot carry onion paths"),
    ("[relays]\nproxies = 3\n", "relays.proxies: must be an integer from 4 to 16, got 3"),
    ("[client]\nmodel = \"small\"\n", "client.model: 'small' is served by no node; the nodes claim gt"),
    ("[client]\nprompt = \"\"\n", "client.prompt: must be a non-empty string"),
    ("[client]\nmax_tokens = 0\n", "client.max_tokens: must be an integer from 1 to 1024"),
    ("[client]\nhttp = \"0.0.0.0:8080\"\n", "client.http: must be empty or \"127.0.0.1:PORT\""),
    ("[dashboard]\nhttp = \"localhost:8600\"\n", "dashboard.http: must be empty or \"127.0.0.1:PORT\", got "
                                                  "'localhost:8600'"),
    ("[dashboard]\nhttp = 8600\n", "dashboard.http: must be empty or \"127.0.0.1:PORT\", got 8600"),
    ("[dashboard]\nport = 8600\n", "dashboard.port: unknown setting; dashboard takes http"),
    ("dashboard = 1\n", r"dashboard: must be a table \(\[dashboard\]\)"),
    ("[client]\nhttp = \"127.0.0.1:8080\"\n[dashboard]\nhttp = \"127.0.0.1:8080\"\n",
     "dashboard.http: 127.0.0.1:8080 is the client relay's address"),
    ("nodes = []\n", "network.verifiers: verifiers challenge model nodes"),
    ("nodes = []\n[network]\nverifiers = false\n[relays]\ncount = 2\n", "relays.count: 2 relay"),
])
def test_each_bad_setting_gets_its_own_error(text, message):
    with pytest.raises(ConfigError, match=message) as caught:
        parse_config(text, SOURCE)
    assert str(caught.value).startswith(f"{SOURCE}: ")
