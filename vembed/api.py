"""The Python entry point for using a trained model, whatever its kind: `vembed.load(path)` gives an `Embedder`
(`encode`, `search`), a `Classifier` (`predict`, and `encode`) or a `Reranker` (`rank`, `score`)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Union

import torch
import torch.nn.functional as F

from vembed.data.records import Side
from vembed.models.encoding import encode_sides

if TYPE_CHECKING:
    from PIL import Image

    from vembed.losses.saved_state import SavedLoss
    from vembed.models.base import EmbeddingAdapter
    from vembed.retrieval.token_index import HnswSettings

ImageInput = Union[str, os.PathLike, "Image.Image"]


def _default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


class Embedder:
    """A saved vembed model ready to embed texts, images, or text+image pairs.

    >>> model = vembed.load("runs/demo/final")
    >>> q = model.encode(texts=["a red square"])           # (1, dim)
    >>> d = model.encode(images=["square.png"])             # paths or PIL images
    >>> scores = q @ d.T                                    # cosine similarities
    """

    def __init__(self, adapter: "EmbeddingAdapter", device: str | torch.device | None = None,
                 loss: "SavedLoss | None" = None):
        self.device = torch.device(device or _default_device())
        self.adapter = adapter.to(self.device).eval()
        # The trained state of the loss, when the run saved one beside the model (ArcFace's class centres).
        self.loss = loss
        if loss is not None and loss.module is not None:
            loss.module.to(self.device)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, device: str | torch.device | None = None, *,
                        trust_remote_code: bool = False) -> "Embedder":
        """Load a folder written by vembed (`output_dir/final` or a checkpoint's model), whatever its adapter.

        `device`: where to run (default: cuda when available, else cpu). `trust_remote_code`: let the folder run
        Python code it ships (models trained with `trust_remote_code: true` may need it); never on the folder's say.
        """
        from vembed.classification import load_saved_loss
        from vembed.models.base import load_adapter

        _refuse_a_reranker(path)
        return cls(load_adapter(Path(path), trust_remote_code=trust_remote_code), device=device,
                   loss=load_saved_loss(path))

    @property
    def embedding_dim(self) -> int:
        return self.adapter.embedding_dim

    @property
    def model_type(self) -> str:
        return self.adapter.model_type

    def encode(
        self,
        texts: str | Sequence[str] | None = None,
        images: ImageInput | Sequence[ImageInput | Sequence[ImageInput]] | None = None,
        batch_size: int = 32,
        show_progress: bool = False,
        normalize: bool | None = None,
        role: str | None = None,
    ) -> torch.Tensor:
        """Embed texts, images, or both; returns a CPU float32 tensor `(n, embedding_dim)`.

        - only `texts` (or only `images`): one row per item;
        - both, of equal length: item i is ONE side with text i and image i (e.g. a composed query "this shirt, in
          red"), fused as the adapter fuses text+image sides; one row per pair. To embed texts and images
          separately, call `encode` twice.

        `role="query"` embeds the items as queries: adapters with per-side instructions (qwen_vl) then use the
        query instruction; otherwise the document one.

        A single string or image is treated as a list of one. Images are file paths or PIL images; with qwen_vl an
        item may itself be a list of them (several images in one side). Rows are
        L2-normalised unless `normalize=False` (then they are whatever the model outputs); a sparse (SPLADE) model's
        only when asked (`normalize=True`): its vectors are scored by dot product.
        """
        if self.multi_vector:
            raise ValueError("this is a multi_vector (late-interaction: ColBERT, ColQwen) model: it gives token "
                             "vectors, not one vector per item; use encode_token_vectors(texts, images=..., role=...) "
                             "and score(queries, documents)")
        sides = _sides(texts, images, role, "encode")
        embeddings = encode_sides(self.adapter, sides, batch_size=batch_size, show_progress=show_progress)
        if normalize is None:
            normalize = not self.sparse
        if normalize:
            embeddings = F.normalize(embeddings, dim=-1)
        return embeddings.cpu()

    def class_scores(self, texts: str | Sequence[str] | None = None,
                     images: ImageInput | Sequence[ImageInput] | None = None, batch_size: int = 32) -> torch.Tensor:
        """`(n, classes)` CPU float32: each item against each training class of a model whose loss kept a state per
        class, saved with it (`loss.safetensors`; sub-center ArcFace: the cosine to the class's nearest centre).
        Columns follow `class_names`."""
        module = self.loss.module if self.loss is not None else None
        if module is None or not hasattr(module, "class_scores"):
            raise ValueError("this model was saved without a loss state that scores classes; class scores come with "
                             "models trained with loss_type: subcenter_arcface (their final/ holds loss.safetensors)")
        embeddings = self.encode(texts, images, batch_size=batch_size, normalize=False)
        return module.class_scores(embeddings.to(self.device)).float().cpu()

    def classify(self, texts: str | Sequence[str] | None = None,
                 images: ImageInput | Sequence[ImageInput] | None = None, batch_size: int = 32) -> list[Any]:
        """The best-scoring training class of each item (`class_scores`): its name, or its id when none was saved."""
        best = self.class_scores(texts, images, batch_size=batch_size).argmax(dim=1).tolist()
        names = self.class_names
        return [names[index] for index in best] if names else best

    @property
    def class_names(self) -> list[str] | None:
        """The training classes by id, as saved with the loss state (None without one)."""
        return self.loss.class_names if self.loss is not None else None

    @property
    def multi_vector(self) -> bool:
        """Whether the model gives token vectors (`embedding: multi_vector`: ColBERT, ColQwen), not one per side."""
        return getattr(self.adapter.settings, "embedding", "single") == "multi_vector"

    @property
    def sparse(self) -> bool:
        """Whether the model gives sparse vocabulary-sized vectors (`embedding: sparse`: SPLADE), scored by dot
        product."""
        return getattr(self.adapter.settings, "embedding", "single") == "sparse"

    def encode_token_vectors(self, texts: str | Sequence[str] | None = None, role: str | None = None,
                             batch_size: int = 32, show_progress: bool = False,
                             images: ImageInput | Sequence[ImageInput | Sequence[ImageInput]] | None = None,
                             ) -> torch.Tensor:
        """Token vectors of a multi_vector (ColBERT, ColQwen) model: a CPU float32 tensor `(n, T, dim)`, row i
        holding item i's L2-normalised token vectors and zero vectors where it has no token
        (`vembed.models.token_vectors`). Items are texts, images (ColQwen: page screenshots), or both, as in `encode`.

        `role` (required): "query" or "document", prepared as in training (ColBERT: the query prefix and expansion
        to query_length, or the document prefix and skip-list; ColQwen: the query or the document instruction)."""
        if not self.multi_vector:
            raise ValueError(f"this {self.model_type} model gives one vector per text; use encode")
        if role not in ("query", "document"):
            raise ValueError(f"role must be 'query' or 'document', got {role!r}")
        sides = _sides(texts, images, role, "encode_token_vectors")
        return encode_sides(self.adapter, sides, batch_size=batch_size, show_progress=show_progress).cpu()

    @staticmethod
    def score(queries: torch.Tensor, documents: torch.Tensor) -> torch.Tensor:
        """`(n_queries, n_documents)` late-interaction (MaxSim) scores of `encode_token_vectors` outputs."""
        from vembed.models.maxsim import maxsim

        return maxsim(queries, documents)

    def search(self, queries: str | Sequence[str] | None, corpus: Sequence[Any], top_k: int = 10, *,
               query_images: Sequence[ImageInput] | None = None, batch_size: int = 32,
               show_progress: bool = False, index: "str | HnswSettings" = "exact") -> list[list[dict[str, float]]]:
        """Each query's `top_k` best items of `corpus` (texts, or images: paths or PIL), best first, as
        sentence-transformers' `util.semantic_search` returns them: `[[{"corpus_id": i, "score": s}, ...], ...]`.

        Queries are texts (or `query_images`), embedded as queries, the corpus as documents; scores are cosines,
        dot products for a sparse (SPLADE) model, or MaxSim for a multi_vector (ColBERT, ColQwen) model. The search
        is `vembed search`'s: exact, equal scores ranked by corpus position. A multi_vector model can search
        approximately instead (`vembed search --index hnsw`): `index="hnsw"`, or a
        `vembed.retrieval.token_index.HnswSettings` for other knobs; the documents it returns keep their exact
        scores, but some of the exact top_k may be missing (needs voyager). A sparse model searches an inverted
        index of its vectors' non-zero weights (`vembed.retrieval.sparse_index`, needs scipy), pruned by the model's
        `sparse_query_top_k` / `sparse_document_top_k` when set. A multi_vector model's documents are pooled by its
        `document_pool_factor` when set, as `vembed search` pools them."""
        from vembed.retrieval.maxsim_search import maxsim_top_k, pack_documents, pool_factor_of
        from vembed.retrieval.scoring import top_k as cosine_top_k
        from vembed.retrieval.search import search_corpus
        from vembed.retrieval.token_index import TokenIndex

        if top_k < 1:
            raise ValueError(f"top_k must be at least 1, got {top_k}")
        settings = self._index_settings(index)
        texts, images = _corpus_items(corpus)
        kwargs = dict(batch_size=batch_size, show_progress=show_progress)
        if self.multi_vector:
            query_vectors = self.encode_token_vectors(queries, role="query", images=query_images, **kwargs)
            documents = self.encode_token_vectors(texts, role="document", images=images, **kwargs)
            packed = pack_documents(documents, pool_factor_of(self.adapter))  # the model's document_pool_factor
            found = maxsim_top_k(query_vectors, packed, top_k) if settings is None else \
                TokenIndex(packed, settings).search(query_vectors, top_k)
        elif self.sparse:
            found = search_corpus(self.adapter, _sides(queries, query_images, "query", "search"),
                                  _sides(texts, images, "document", "search"), top_k, **kwargs)
        else:
            found = cosine_top_k(self.encode(queries, images=query_images, role="query", **kwargs),
                                 self.encode(texts, images=images, role="document", **kwargs), top_k)
        return [[{"corpus_id": int(i), "score": float(score)} for i, score in zip(indices, scores) if i >= 0]
                for indices, scores in zip(found.indices.tolist(), found.scores.tolist())]

    def _index_settings(self, index: "str | HnswSettings") -> "HnswSettings | None":
        """What `search`'s `index` asks for: None for exact search, else the approximate index's settings."""
        from vembed.retrieval.search import scoring_of
        from vembed.retrieval.token_index import EXACT, HNSW, HnswSettings, require_voyager

        if isinstance(index, str) and index == EXACT:
            return None
        if not (index == HNSW or isinstance(index, HnswSettings)):
            raise ValueError(f"index must be {EXACT!r}, {HNSW!r} or an HnswSettings, got {index!r}")
        if not self.multi_vector:
            scoring = scoring_of(self.adapter)
            raise ValueError(f"index={HNSW!r} indexes token vectors; this {self.model_type} model gives "
                             f"{scoring.vectors} (its search is exact {scoring.name})")
        require_voyager("index")
        return index if isinstance(index, HnswSettings) else HnswSettings()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(model_type={self.model_type!r}, embedding_dim={self.embedding_dim}, " \
               f"device={self.device})"


class Classifier(Embedder):
    """A saved image classifier (a backbone with a class head): `predict` gives each image's top classes, and
    `encode` the backbone's pooled embedding as for any vision model.

    >>> model = vembed.load("runs/vit/final")
    >>> model.predict(["cat.png"], top_k=2)   # [[{"label": "cat", "score": 0.91}, {"label": "dog", "score": 0.05}]]
    """

    @property
    def labels(self) -> list[str]:
        """The class names, in the head's order."""
        names = self.adapter.settings.label_names
        return list(names) if names is not None else [str(i) for i in range(self.adapter.settings.num_labels)]

    def predict_proba(self, images: ImageInput | Sequence[ImageInput], batch_size: int = 32,
                      show_progress: bool = False) -> torch.Tensor:
        """Class probabilities `(n, num_labels)` (softmax of the head's logits), CPU float32. An image that does not
        decode is a `DataError` naming its file."""
        from vembed.data.images import load_image

        images = [images] if isinstance(images, (str, os.PathLike)) or _is_pil(images) else list(images)
        parts = []
        steps = range(0, len(images), batch_size)
        if show_progress:
            from tqdm.auto import tqdm

            steps = tqdm(steps, desc="predicting", unit="batch")
        with torch.no_grad():
            for start in steps:
                decoded = [load_image(os.fspath(image) if isinstance(image, os.PathLike) else image)
                           for image in images[start : start + batch_size]]
                inputs = self.adapter.preprocess([Side(image=image) for image in decoded])
                logits = self.adapter.classify({k: v.to(self.device) for k, v in inputs.items()})
                parts.append(logits.float().softmax(dim=-1).cpu())
        return torch.cat(parts) if parts else torch.zeros(0, len(self.labels))

    def predict(self, images: ImageInput | Sequence[ImageInput], top_k: int = 1, batch_size: int = 32,
                show_progress: bool = False) -> list[list[dict[str, Any]]]:
        """Each image's `top_k` classes, most probable first: `[[{"label": name, "score": probability}, ...], ...]`
        (equal probabilities: the lower class index first, as the evaluation's argmax takes it)."""
        if top_k < 1:
            raise ValueError(f"top_k must be at least 1, got {top_k}")
        probabilities = self.predict_proba(images, batch_size=batch_size, show_progress=show_progress)
        order = probabilities.argsort(dim=1, descending=True, stable=True)[:, :top_k]
        labels = self.labels
        return [[{"label": labels[c], "score": float(p[c])} for c in row.tolist()]
                for p, row in zip(probabilities, order)]


class Reranker:
    """A saved reranker (cross-encoder, Qwen-VL reranker): `rank` orders documents for a query, `score` scores
    pairs, in the shape of sentence-transformers' `CrossEncoder.rank` / `predict`.

    >>> model = vembed.load("runs/reranker/final")
    >>> model.rank("how do I sort a list", ["Sort the integers.", "Parse the dates."])
    [{"corpus_id": 0, "score": 4.2}, {"corpus_id": 1, "score": -3.1}]
    """

    def __init__(self, model: torch.nn.Module, device: str | torch.device | None = None):
        self.device = torch.device(device or _default_device())
        self.model = model.to(self.device).eval()

    @property
    def model_type(self) -> str:
        return self.model.model_type

    def score(self, queries: str | Sequence[Any], documents: Sequence[Any], batch_size: int = 32) -> torch.Tensor:
        """`(n,)` scores (logits) of the pairs (queries[i], documents[i]); one query string scores every document."""
        if isinstance(queries, str):
            queries = [queries] * len(documents)
        with torch.no_grad():
            return self.model.score(list(queries), list(documents), batch_size=batch_size).float().cpu()

    def rank(self, query: Any, documents: Sequence[Any], top_k: int | None = None, *,
             return_documents: bool = False, batch_size: int = 32) -> list[dict[str, Any]]:
        """`documents` ordered for `query`, best first: `[{"corpus_id": i, "score": s}, ...]` (with `"text"` when
        `return_documents`), the first `top_k` (None: all). The scores are `vembed rerank`'s for the same pairs."""
        if top_k is not None and top_k < 1:
            raise ValueError(f"top_k must be at least 1, got {top_k}")
        scores = self.score([query] * len(documents), documents, batch_size=batch_size)
        order = scores.argsort(descending=True, stable=True)[:top_k].tolist()
        return [{"corpus_id": i, "score": float(scores[i]), **({"text": documents[i]} if return_documents else {})}
                for i in order]

    def __repr__(self) -> str:
        return f"Reranker(model_type={self.model_type!r}, device={self.device})"


def load_model(path: str | os.PathLike, device: str | torch.device | None = None, *,
               trust_remote_code: bool = False) -> "Embedder | Classifier | Reranker":
    """The saved model at `path` as what it is for: a `Reranker`, a `Classifier` (a class head) or an `Embedder`."""
    from vembed.classification import load_saved_loss
    from vembed.models.base import load_adapter
    from vembed.reranking import load_reranker, saved_reranker_type

    if saved_reranker_type(path):
        return Reranker(load_reranker(path, trust_remote_code=trust_remote_code), device=device)
    _refuse_a_reranker(path)  # one vembed did not save
    adapter = load_adapter(Path(path), trust_remote_code=trust_remote_code)
    kind = Classifier if getattr(adapter, "classifier", None) is not None else Embedder
    return kind(adapter, device=device, loss=load_saved_loss(path))


def _refuse_a_reranker(path: str | os.PathLike) -> None:
    """A reranker as an embedder, whoever saved it, named by what it is (`require_embedder`) rather than by the
    missing vembed.json."""
    from vembed.models.foreign import require_embedder

    if Path(path).is_dir():
        require_embedder(path, "model", instead="vembed.load loads the rerankers vembed saved: fine-tune this one with "
                                                "a cross_encoder recipe (model_name: this folder)")


def _corpus_items(corpus: Sequence[Any]) -> tuple[list[str] | None, list[Any] | None]:
    """A corpus as texts or as images (paths or PIL), one kind for all items."""
    items = list(corpus)
    if not items:
        raise ValueError("the corpus is empty")
    is_image = [_is_pil(item) or (isinstance(item, (str, os.PathLike)) and _looks_like_image(item)) for item in items]
    if all(is_image):
        return None, items
    if any(is_image) or not all(isinstance(item, str) for item in items):
        raise ValueError("a corpus is all texts or all images (paths or PIL images); embed mixed items apart")
    return items, None


def _looks_like_image(item: str | os.PathLike) -> bool:
    from vembed.data.images import IMAGE_EXTENSIONS

    return Path(item).suffix.lower() in IMAGE_EXTENSIONS and Path(item).is_file()


def _sides(texts: Any, images: Any, role: str | None, method: str) -> list[Side]:
    """`encode`'s items as sides: texts, images, or (equal numbers of) both, one side per item."""
    texts = [texts] if isinstance(texts, str) else texts
    images = [images] if isinstance(images, (str, os.PathLike)) or _is_pil(images) else images
    if texts is None and images is None:
        raise ValueError(f"{method} needs texts, images, or both")
    if texts is not None and images is not None and len(texts) != len(images):
        raise ValueError(
            f"got {len(texts)} texts and {len(images)} images; pairs need equal lengths "
            f"(to embed them separately, call {method}(texts=...) and {method}(images=...))"
        )
    if images is not None:
        images = [os.fspath(img) if isinstance(img, os.PathLike) else img for img in images]
    n = len(texts if texts is not None else images)
    return [Side(text=texts[i] if texts is not None else None, image=images[i] if images is not None else None,
                 role=role) for i in range(n)]


def _is_pil(obj: object) -> bool:
    try:
        from PIL import Image
    except ImportError:  # pragma: no cover - pillow is a dependency
        return False
    return isinstance(obj, Image.Image)
