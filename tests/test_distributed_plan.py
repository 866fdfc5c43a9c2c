"""The distributed worker's plan, without MLX: layer shares, what is refused and why, and
the specs and hostfiles the router hands to the ranks."""

from __future__ import annotations

import json

import pytest

from common.distributed_plan import (
    GroupSpec,
    PlanError,
    check_model,
    hostfile_hosts,
    layer_ranges,
    loopback_hostfile,
)
from common.server_args import ServerArgs
from router.serving.worker_group import launched_spec, local_group

CONFIG = dict(num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
              num_hidden_layers=5)  # fmt: skip


def test_layer_ranges_are_contiguous_and_the_first_stages_take_the_extra_layers():
    assert layer_ranges(5, 2) == [range(0, 3), range(3, 5)]
    assert layer_ranges(4, 4) == [range(i, i + 1) for i in range(4)]
    assert layer_ranges(7, 3) == [range(0, 3), range(3, 5), range(5, 7)]
    assert layer_ranges(3, 1) == [range(0, 3)]


def test_more_stages_than_layers_is_refused():
    with pytest.raises(PlanError, match="--pp-size 6 needs at least 6 layers; the model has 5"):
        check_model(CONFIG, 1, 6)


@pytest.mark.parametrize(
    "tp, what",
    [(3, "4 attention heads"), (4, "2 KV heads")],
)
def test_heads_that_do_not_divide_by_the_tp_size_are_refused(tp, what):
    with pytest.raises(PlanError, match=f"--tp-size {tp}: the model's {what} do not divide"):
        check_model(CONFIG, tp, 1)


def test_a_mlp_width_that_does_not_divide_is_refused():
    with pytest.raises(PlanError, match="129 MLP columns do not divide into 2"):
        check_model(dict(CONFIG, intermediate_size=129), 2, 1)


def test_splits_that_fit_pass_and_a_nested_text_config_is_read():
    check_model(CONFIG, 2, 1)
    check_model(CONFIG, 1, 5)
    check_model({"text_config": CONFIG}, 2, 1)
    with pytest.raises(PlanError):
        check_model({"text_config": CONFIG}, 3, 1)


def test_server_args_refuse_tp_with_pp_and_non_ring_backends_without_a_hostfile():
    with pytest.raises(ValueError, match="cannot both be above 1"):
        ServerArgs(model_path="m", tp_size=2, pp_size=2).validate()
    with pytest.raises(ValueError, match="--dist-backend jaccl needs --dist-hostfile"):
        ServerArgs(model_path="m", tp_size=2, dist_backend="jaccl").validate()
    with pytest.raises(ValueError, match="--tp-size and --pp-size must be >= 1"):
        ServerArgs(model_path="m", pp_size=0).validate()
    ServerArgs(model_path="m", pp_size=2).validate()
    assert ServerArgs(model_path="m", tp_size=4).group_size == 4


def test_names_follow_the_rank():
    spec = GroupSpec(0, 2, 1, "ring", "h")
    assert (spec.name, spec.size, spec.mode) == ("worker", 2, "tensor")
    assert GroupSpec(3, 1, 4, "ring", "h").name == "worker-3"
    assert GroupSpec(3, 1, 4, "ring", "h").mode == "pipeline"


def test_local_group_writes_a_loopback_ring_hostfile_and_one_socket_per_rank(tmp_path):
    args = ServerArgs(model_path="m", pp_size=3, dist_port=41000)
    specs = local_group(args, str(tmp_path), "ipc")
    assert [s.rank for s in specs] == [0, 1, 2]
    assert json.loads((tmp_path / "hostfile.json").read_text()) == loopback_hostfile(
        [41000, 41001, 41002]
    )
    assert specs[0].fanout == tuple(f"ipc://{tmp_path}/rank{r}.sock" for r in range(3))
    assert all(s.ranks_on_host == 3 and s.hostfile == str(tmp_path / "hostfile.json")
               for s in specs)  # fmt: skip
    tcp = local_group(ServerArgs(model_path="m", tp_size=2), str(tmp_path), "tcp")
    assert all(a.startswith("tcp://127.0.0.1:") for a in tcp[1].fanout)


def test_a_launched_rank_reads_mlx_launch_hostfile(tmp_path):
    hosts = [{"ssh": "mac-a", "ips": ["10.0.0.1"]}, {"ssh": "mac-b", "ips": ["10.0.0.2"]}]
    path = tmp_path / "hosts.json"
    path.write_text(json.dumps(hosts))
    assert hostfile_hosts(hosts) == ["10.0.0.1", "10.0.0.2"]
    assert hostfile_hosts([{"ssh": "mac-c"}]) == ["mac-c"]
    assert hostfile_hosts({"backend": "jaccl", "hosts": hosts}) == ["10.0.0.1", "10.0.0.2"]
    assert hostfile_hosts(loopback_hostfile([5, 6])) == ["127.0.0.1", "127.0.0.1"]
    args = ServerArgs(model_path="m", tp_size=2, dist_hostfile=str(path), dist_port=32000)
    spec = launched_spec(args, 1)
    assert spec.fanout == ("tcp://10.0.0.1:32000", "tcp://10.0.0.1:32001")
    assert (spec.rank, spec.hostfile, spec.ranks_on_host) == (1, "", 1)
    with pytest.raises(ValueError, match="lists 2 hosts; --tp-size/--pp-size ask for 4"):
        launched_spec(ServerArgs(model_path="m", tp_size=4, dist_hostfile=str(path)), 0)
