"""The package keeps the design's shape (see test/structure.py and docs/architecture.md), and the measures bite."""

from __future__ import annotations

from pathlib import Path

from structure import MAX_ATTRIBUTES, class_sizes, instance_attributes, package_circles, private_reach_ins

REPO = Path(__file__).resolve().parent.parent


def test_no_class_owns_more_than_the_target_of_instance_attributes() -> None:
    sizes = class_sizes(REPO)
    assert len(sizes) > 100, 'the reader found too few classes'
    over = [f'{cls}: {n}' for n, cls in sizes if n > MAX_ATTRIBUTES]
    assert over == [], f'give part of their state to small classes that own it: {over}'


def test_no_import_circle_inside_a_package() -> None:
    assert package_circles(REPO) == []


def test_no_module_reaches_into_another_modules_private_names() -> None:
    assert private_reach_ins(REPO) == []


def test_the_measures_see_what_they_are_for(tmp_path: Path) -> None:
    source = ('class A:\n'
              '    def __init__(self):\n'
              '        self.a = self.b = 0\n'
              '        self.c: int = 1\n'
              '    def f(self, x):\n'
              '        self.a += 1\n'
              '        self.d, (self.e, x.z) = 1, (2, 3)\n')
    assert instance_attributes(source) == {'A': {'a', 'b', 'c', 'd', 'e'}}
    pkg = tmp_path / 'sequence_ai_ros' / 'p'
    pkg.mkdir(parents=True)
    (tmp_path / 'sequence_ai_ros' / '__init__.py').write_text('')
    (pkg / '__init__.py').write_text('')
    (pkg / 'a.py').write_text('from typing import TYPE_CHECKING\n'
                              'if TYPE_CHECKING:\n    from sequence_ai_ros.p.b import B\n'
                              'from sequence_ai_ros.p.c import _hidden\n')
    (pkg / 'b.py').write_text('from sequence_ai_ros.p import a\nfrom sequence_ai_ros.p.c import C\n'
                              'def f(c: C):\n    return a._x, c._y\n')
    (pkg / 'c.py').write_text('class C:\n    _y = 1\n_hidden = 2\n')
    assert package_circles(tmp_path) == [['sequence_ai_ros.p.a', 'sequence_ai_ros.p.b']]
    assert private_reach_ins(tmp_path) == ['sequence_ai_ros.p.a: imports sequence_ai_ros.p.c._hidden',
                                           'sequence_ai_ros.p.b: reads C._y (of c)',
                                           'sequence_ai_ros.p.b: reads sequence_ai_ros.p.a._x']
