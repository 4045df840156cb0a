"""config.mesh as a typed, frozen section: the device mesh's axis sizes and logical-axis rules.

`config_lib.base_config` builds config.mesh from these defaults and `config_lib.resolve` builds
the section from it; `runtime.sharding` makes the mesh.
"""

from __future__ import annotations

import dataclasses
import math

from memjax.errors import failed

MESH_AXES = ('data', 'fsdp', 'tensor')


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """config.mesh: the device mesh ('data', 'fsdp', 'tensor'); one size may be -1 (all remaining
    devices). rules: ((logical_name, mesh_axes), ...) replacing entries of
    memjax.runtime.sharding.DEFAULT_RULES, e.g. (('vocab', None),) to replicate the vocabulary."""

    data: int = -1
    fsdp: int = 1
    tensor: int = 1
    rules: tuple = ()

    @property
    def sizes(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in MESH_AXES}

    def shape(self, device_count: int) -> dict[str, int]:
        """Axis sizes with the -1 entry (if any) filled so that they multiply to device_count."""
        fixed = math.prod(size for size in self.sizes.values() if size != -1)
        return {name: device_count // fixed if size == -1 else size for name, size in self.sizes.items()}

    def problems(self) -> list[str]:
        bad = [f'config.mesh.{n}={v}' for n, v in self.sizes.items() if not isinstance(v, int) or (v != -1 and v < 1)]
        found = failed((not bad, f'{", ".join(bad)}: mesh sizes must be positive ints or -1.'),
                       (list(self.sizes.values()).count(-1) <= 1,
                        f'config.mesh {self.sizes}: at most one size may be -1 (the remaining devices).'))
        for rule in self.rules:
            ok = (isinstance(rule, (tuple, list)) and len(rule) == 2 and isinstance(rule[0], str)
                  and all(axis in MESH_AXES for axis in
                          ((rule[1],) if rule[1] is None or isinstance(rule[1], str) else rule[1]) if axis is not None))
            found += failed((ok, f'config.mesh.rules entry {rule!r} must be (logical_name, mesh_axes) '
                             f'with mesh_axes None, one of {MESH_AXES} or a tuple of them.'))
        return found

    def device_problems(self, device_count: int) -> list[str]:
        """Whether the sizes fit `device_count` devices (after `problems` found none)."""
        sizes = self.sizes
        fixed = math.prod(size for size in sizes.values() if size != -1)
        if -1 in sizes.values() and device_count % fixed:
            return [f'config.mesh {sizes}: the fixed sizes multiply to {fixed}, which does not '
                    f'divide the {device_count} devices.']
        if -1 not in sizes.values() and fixed != device_count:
            shape = 'x'.join(f'{n}={v}' for n, v in self.shape(device_count).items())
            return [f'config.mesh {shape} has {fixed} devices but {device_count} are present: '
                    'make the sizes multiply to the device count or set one of them to -1.']
        return []
