"""doctor: the profile's network against the live cluster's topology (pure: the facts come in)."""

from __future__ import annotations

from hostlist import collect_hostlist, expand_hostlist  # SLURM hostlist notation

from launcher.spec.profile_draft import ClusterFacts, live_network
from launcher.spec.profiles import Profile
from lmcore.text_rules import brief


def network_differences(profile: Profile, facts: ClusterFacts) -> list[str]:
    """Where the profile's network is not the cluster's topology (a placement would ask SLURM for
    switches or blocks it does not have, or lay ranks out by groups that are not there)."""
    kind, groups, sizes = live_network(facts.config.get("TopologyPlugin", ""), facts.topology)
    net = profile.network
    if net.topology != kind and not (kind == "none" and net.topology == "none"):
        return [f"network.topology {net.topology}, the cluster's TopologyPlugin is "
                f"{facts.config.get('TopologyPlugin') or 'topology/none'}"]
    theirs = {name: set(expand_hostlist(nodes)) for name, nodes in groups}
    mine = {name: set(nodes) for name, nodes in net.members().items()}
    out = [f"network.groups {name}: {brief(net.groups[name])}, the cluster's {name} "
           f"{'is not there' if name not in theirs else 'has ' + collect_hostlist(sorted(theirs[name]))}"
           for name in sorted(mine) if mine[name] != theirs.get(name)]
    out += [f"the cluster's {name} is not in network.groups" for name in sorted(set(theirs) - set(mine))]
    if net.block_sizes and sizes and net.block_sizes != sizes:
        out.append(f"network.block_sizes {net.block_sizes}, the cluster's {sizes}")
    return out
