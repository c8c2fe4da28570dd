"""The VAE workload: a convolutional variational autoencoder as a Task in the same loop as classification.

Pixels are modelled as Bernoulli variables in [0, 1] (recipes set data.normalize=false), so per image

    reconstruction_loss = -log p(x | z)  (binary cross-entropy summed over pixels, in nats)
    kl                  = KL(q(z | x) || N(0, I))
    loss                = reconstruction_loss + model.beta * kl   (= -ELBO when beta = 1)

Evaluation decodes the posterior mean instead of a random sample, so eval numbers do not depend on the
random state of each process and are the same at any world size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from accel_train.config import Config, ModelConfig
from accel_train.data import Data
from accel_train.errors import UserError, writing
from accel_train.import_paths import is_import_path
from accel_train.registry import Registry
from accel_train.state import Observer, State
from accel_train.workloads.tasks.base import TASKS, Task, WithComputeArgs

VAE_MODELS: Registry[nn.Module] = Registry("VAE model", "model.name")
TERMS = ("loss", "reconstruction_loss", "kl")


@VAE_MODELS.register("conv_vae")
class ConvVAE(nn.Module):
    """Two stride-2 convolutions down to (H/4, W/4), an MLP to the Gaussian posterior, and the mirror image back."""

    def __init__(self, image_shape: tuple[int, int, int], latent_size: int, hidden_size: int) -> None:
        super().__init__()
        channels, height, width = image_shape
        if height % 4 or width % 4:
            raise UserError(f"model.name=conv_vae needs image sides divisible by 4, got {height}x{width}; "
                            "set data.image_size to a multiple of 4")
        self.latent_size = latent_size
        grid = (64, height // 4, width // 4)
        flat = grid[0] * grid[1] * grid[2]
        self.encoder = nn.Sequential(
            nn.Conv2d(channels, 32, 4, stride=2, padding=1), nn.ReLU(),
            nn.Conv2d(32, 64, 4, stride=2, padding=1), nn.ReLU(),
            nn.Flatten(), nn.Linear(flat, hidden_size), nn.ReLU(),
            nn.Linear(hidden_size, 2 * latent_size),
        )
        self.decoder = nn.Sequential(
            nn.Linear(latent_size, hidden_size), nn.ReLU(), nn.Linear(hidden_size, flat), nn.ReLU(),
            nn.Unflatten(1, grid),
            nn.ConvTranspose2d(64, 32, 4, stride=2, padding=1), nn.ReLU(),
            nn.ConvTranspose2d(32, channels, 4, stride=2, padding=1),
        )

    def forward(self, images: torch.Tensor, sample: bool = True):
        """Pixel logits of the reconstruction, and the posterior's mean and log-variance."""
        mean, log_var = self.encoder(images).chunk(2, dim=1)
        z = mean + torch.randn_like(mean) * (0.5 * log_var).exp() if sample else mean
        return self.decoder(z), mean, log_var

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        return self.decoder(z)


def per_sample_terms(logits, images, mean, log_var, beta: float) -> dict[str, torch.Tensor]:
    """The three loss terms of each image, in nats (float32 even under mixed precision)."""
    logits, mean, log_var = logits.float(), mean.float(), log_var.float()
    reconstruction = F.binary_cross_entropy_with_logits(logits, images.float(), reduction="none").flatten(1).sum(1)
    kl = 0.5 * (mean.pow(2) + log_var.exp() - 1 - log_var).sum(1)
    return {"loss": reconstruction + beta * kl, "reconstruction_loss": reconstruction, "kl": kl}


@TASKS.register("vae")
class VAETask(Task):
    metrics = dict.fromkeys(TERMS, "min")
    num_pictures = 32  # eval inputs shown above their reconstructions
    num_samples = 64  # images decoded from the prior
    pictures: dict | None = None

    def check_config(self, config: Config) -> None:
        from accel_train.data import check_data_name
        from accel_train.workloads.models import check_model

        check_data_name(config.data)
        if is_import_path(config.model.name):
            check_model(config.model)
        else:
            VAE_MODELS.get(config.model.name)
        if config.data.normalize:
            raise UserError("task=vae models pixel values in [0, 1] (Bernoulli likelihood): set data.normalize=false")

    def setup(self, config: Config, data: Data) -> None:
        self.beta, self.seed = config.model.beta, config.seed

    def build_model(self, config: Config, data: Data) -> nn.Module:
        cfg: ModelConfig = config.model
        if cfg.name in VAE_MODELS:
            return VAE_MODELS.get(cfg.name)(data.image_shape, cfg.latent_size, cfg.hidden_size)
        # any other name is an import path (check_config let no other through): the user's VAE, whose
        # forward(images, sample) -> (logits, mean, log_var), and decode
        from accel_train.workloads.models import build_by_import_path

        return build_by_import_path(cfg, None, data.image_shape)

    def training_step(self, model, batch):
        images, _ = batch
        logits, mean, log_var = model(images)
        terms = per_sample_terms(logits, images, mean, log_var, self.beta)
        return {name: value.mean() for name, value in terms.items()}

    def eval_step(self, model, batch):
        images, _ = batch
        logits, mean, log_var = model(images, sample=False)
        if self.pictures is None:
            self.pictures = self._pictures(model, images, logits)
        return per_sample_terms(logits, images, mean, log_var, self.beta)

    def new_metric(self):
        from accel_train.workloads.metrics import MeanValues, in_memory

        self.pictures = None  # refilled from the first eval batch of this evaluation
        return WithComputeArgs(in_memory(MeanValues, TERMS))

    def observers(self, config: Config) -> list[Observer]:
        return [VAEPictures(self)]

    def _pictures(self, model, images, logits) -> dict[str, torch.Tensor]:
        from accelerate.utils import extract_model_from_parallel

        vae = extract_model_from_parallel(model)
        shown = min(self.num_pictures, len(images))
        if shown > VAEPictures.columns:  # whole rows only, so every input stays above its reconstruction
            shown -= shown % VAEPictures.columns
        # The same prior draws at every evaluation, so successive sample grids show the model's progress.
        z = torch.randn(self.num_samples, vae.latent_size, generator=torch.Generator().manual_seed(self.seed))
        samples = torch.sigmoid(vae.decode(z.to(images.device)).float())
        return {"inputs": images[:shown].float().cpu(), "reconstructions": torch.sigmoid(logits[:shown].float()).cpu(),
                "samples": samples.cpu()}


class VAEPictures(Observer):
    """After each evaluation: eval inputs above their reconstructions, and samples from the prior, as PNG."""

    columns = 8

    def __init__(self, task: VAETask) -> None:
        self.task = task

    def on_eval(self, state: State, metrics: dict, split: str) -> None:
        from torchvision.utils import save_image

        pictures = self.task.pictures
        if not pictures:
            return
        columns = min(self.columns, len(pictures["inputs"]))
        folder = state.place.folder / "images"
        with writing(folder, "drawing the VAE's pictures"):
            folder.mkdir(parents=True, exist_ok=True)
            step = state.progress.step
            save_image(pairs_of_rows(pictures["inputs"], pictures["reconstructions"], columns),
                       folder / f"reconstructions_step{step:06d}.png", nrow=columns, pad_value=1.0)
            save_image(pictures["samples"], folder / f"samples_step{step:06d}.png", nrow=self.columns,
                       pad_value=1.0)


def pairs_of_rows(inputs: torch.Tensor, outputs: torch.Tensor, columns: int) -> torch.Tensor:
    """Interleave rows so each row of inputs sits directly above the row of its reconstructions."""
    rows = []
    for start in range(0, len(inputs), columns):
        rows += [inputs[start:start + columns], outputs[start:start + columns]]
    return torch.cat(rows)

