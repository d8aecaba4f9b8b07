"""sentence-transformers folders around a model folder, for testing and benchmarking embeddings without a download.

`make_st_folder` writes the files of the classic layout most embedding models on the hub have (modules.json with
`sentence_transformers.models.*` types, 1_Pooling/config.json with `pooling_mode_*` switches, no modality_config,
so sentence-transformers embeds plain text, never a chat-template rendering) beside links to the model's files.
"""

from __future__ import annotations

import json
from pathlib import Path

# our pooling_type -> sentence-transformers' 1_Pooling/config.json switch
ST_POOLING_MODES = {
    "mean": "pooling_mode_mean_tokens", "last": "pooling_mode_lasttoken", "cls": "pooling_mode_cls_token",
}
_ALL_SWITCHES = ("pooling_mode_cls_token", "pooling_mode_mean_tokens", "pooling_mode_max_tokens",
                 "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens", "pooling_mode_lasttoken")


def make_st_folder(model_dir: str | Path, folder: str | Path, pooling_type: str, normalize: bool,
                   max_seq_length: int = 512) -> Path:
    """`folder`: links to every file of `model_dir` plus Transformer -> Pooling(pooling_type) [-> Normalize]."""
    model_dir, folder = Path(model_dir).resolve(), Path(folder)
    folder.mkdir(parents=True)
    for path in model_dir.iterdir():
        if path.is_file():
            (folder / path.name).symlink_to(path.resolve())
    hidden_size = json.loads((model_dir / "config.json").read_text())["hidden_size"]
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
        (folder / "2_Normalize").mkdir()
    (folder / "modules.json").write_text(json.dumps(modules, indent=2))
    pooling = {"word_embedding_dimension": hidden_size}
    pooling |= {switch: switch == ST_POOLING_MODES[pooling_type] for switch in _ALL_SWITCHES}
    pooling["include_prompt"] = True
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(pooling, indent=2))
    (folder / "sentence_bert_config.json").write_text(
        json.dumps({"max_seq_length": max_seq_length, "do_lower_case": False})
    )
    return folder
