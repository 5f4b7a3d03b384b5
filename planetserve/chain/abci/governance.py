"""What the committee's votes change at the start of a block (handlers/committee.py approves them):
parameter changes approved for that height, and an upgrade reaching its height.

An upgrade works as Cosmos SDK's x/upgrade does: at the plan's height an app older than the plan's
version stops before executing the block, with a message that names the version needed; the operator
starts the newer app, CometBFT hands it the same block again, and that app runs its migration for the
plan's name, records the new version in the state and tells CometBFT, whose headers carry it from the
next block on. An app that is newer than the chain's version runs the chain's rules until then."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from planetserve.chain.abci.state import IterableKV, State
from planetserve.registry.errors import InvalidField
from planetserve.registry.params import Params

log = logging.getLogger(__name__)

Migration = Callable[[State], None]


class UpgradeNeeded(RuntimeError):
    """This app is older than the version the chain runs from this block on: stop here."""


@dataclass
class Changes:
    """What the start of a block changed."""

    params: Params | None = None
    app_version: int | None = None
    events: list[tuple[str, dict[str, str]]] = field(default_factory=list)


def begin_block(batch: IterableKV, height: int, app_version: int,
                migrations: Mapping[str, Migration]) -> Changes:
    """Apply what is due at `height`. Raises UpgradeNeeded when this app (`app_version`) is older than
    an upgrade due now."""
    st = State(batch)
    out = Changes()
    pending = st.param_changes(height)
    if pending:
        st.delete_param_changes(height)
        try:
            out.params = st.params().changed(pending)
        except InvalidField as exc:  # two approved changes that do not hold together: neither applies
            out.events.append(("params_change_failed", {"height": str(height), "reason": str(exc)}))
        else:
            st.put_params(out.params)
            out.events.append(("params_changed", {"height": str(height), "names": ",".join(sorted(pending))}))
    plan = st.upgrade()
    if plan is not None and plan.height == height:
        if app_version < plan.app_version:
            message = (f"UPGRADE {plan.name!r} NEEDED at height {height}: this app is version {app_version}, "
                       f"the chain runs version {plan.app_version} from here on; start the newer app")
            log.error(message)
            raise UpgradeNeeded(message)
        migrate = migrations.get(plan.name)
        if migrate is not None:
            migrate(st)
        st.put_app_version(plan.app_version)
        st.delete_upgrade()
        out.app_version = plan.app_version
        out.events.append(("upgraded", {"name": plan.name, "app_version": str(plan.app_version)}))
    return out
