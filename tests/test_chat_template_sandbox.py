"""A chat template from a model folder is someone else's code: the known ways out of a Jinja
sandbox (attribute walks to os and builtins, through lmforge's own globals too, format strings,
mutation) are refused or render nothing of Python's, and a model folder's Python files
(`auto_map`, `trust_remote_code`) are never run."""

from __future__ import annotations

import json

import pytest

from lmforge.chat_template import ChatTemplate, TemplateRefused

pytest.importorskip("jinja2")

MESSAGES = [{"role": "user", "content": "hi"}]

# Each tries to reach the interpreter: to run a command, open a file, or list Python's classes.
ESCAPES = {
    "subclasses": "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "tuple base": "{{ ().__class__.__base__.__subclasses__() }}",
    "messages class": "{{ messages.__class__.__base__.__subclasses__() }}",
    "cycler globals": "{{ cycler.__init__.__globals__.os.system('touch {marker}') }}",
    "lipsum globals": "{{ lipsum.__globals__['os'].popen('touch {marker}').read() }}",
    "self globals": "{{ self.__init__.__globals__.__builtins__.open('{marker}', 'w').write('x') }}",
    "raise_exception globals": "{{ raise_exception.__globals__['os'].system('touch {marker}') }}",
    "strftime_now globals": "{{ strftime_now.__globals__['__builtins__']['open']('{marker}', 'w') }}",
    "namespace init": "{% set n = namespace() %}{{ n.__init__.__globals__['os'].system('touch {marker}') }}",
    "attr filter": "{{ (''|attr('__class__')|attr('__mro__'))[1]|attr('__subclasses__')() }}",
    "format string": "{{ '{0.__class__.__mro__[1].__subclasses__}'.format(messages) }}",
    "mutation": "{{ messages.append({'role': 'user', 'content': 'x'}) }}{{ messages | length }}",
    "getattr builtin": "{{ getattr(messages, '__class__') }}",
}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from lmforge.tokenizers import load_tokenizer
    from tests.eval.conftest import train_tokenizer

    folder = train_tokenizer(
        "the quick brown fox jumps over the lazy dog " * 50,
        ["<|endoftext|>"],
        "<|endoftext|>",
        "<|endoftext|>",
        False,
        tmp_path_factory.mktemp("tok") / "tok",
    )
    return load_tokenizer(folder / "tokenizer.json")


@pytest.mark.parametrize("name", list(ESCAPES))
def test_a_sandbox_escape_is_refused_or_renders_nothing_of_python(name, tokenizer, tmp_path):
    marker = tmp_path / "ran"
    source = ESCAPES[name].replace("{marker}", str(marker))
    try:
        rendered = ChatTemplate(source, tokenizer).render(MESSAGES, True)
    # refused by the sandbox, or undefined: either way not run
    except (TemplateRefused, Exception) as e:
        assert not isinstance(e, (AssertionError, SystemExit)), e
        rendered = ""
    assert not marker.exists(), "the template ran a command"
    for sign in ("<class", "<module", "<built-in", "subclasses", "os.system", "<function"):
        assert sign not in rendered, rendered[:300]
    if name == "mutation":
        assert MESSAGES == [{"role": "user", "content": "hi"}]


def test_a_model_folders_python_files_never_run(tmp_path):
    """A Hugging Face folder whose config.json names `auto_map` code (what `trust_remote_code`
    would import) and holds that code: importing, converting and generating from it never runs
    the file."""
    pytest.importorskip("transformers")
    from lmforge.models.hf import import_hf
    from lmforge.models.source import load_pretrained
    from tests.conftest import make_hf_model

    folder = tmp_path / "hf"
    make_hf_model("llama").save_pretrained(folder)
    marker = tmp_path / "ran"
    code = f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n"
    for name in (
        "modeling_evil.py",
        "configuration_evil.py",
        "tokenization_evil.py",
        "__init__.py",
    ):
        (folder / name).write_text(code)
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {
        "AutoConfig": "configuration_evil.EvilConfig",
        "AutoModelForCausalLM": "modeling_evil.EvilModel",
    }
    (folder / "config.json").write_text(json.dumps(config))
    load_pretrained(folder)
    import_hf(folder, tmp_path / "imported")
    assert not marker.exists()
    assert not any(p.suffix == ".py" for p in (tmp_path / "imported").iterdir())
