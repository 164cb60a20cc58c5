"""Screenshot of the web demo for the README: caption a test image in headless Chromium,
hover one word, and save the page as a small PNG.

    python -m tools.serve_screenshot --checkpoint runs/quickstart/best.pt --out docs/serve.png

Needs the serve and dev extras and Debian's chromium and chromium-driver
(``make test-browser`` installs them).
"""

from __future__ import annotations

import argparse
import io
import shutil
import sys
from pathlib import Path

from PIL import Image
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.action_chains import ActionChains
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

import captioning
from captioning.serve.app import settings_for
from captioning.serve.server import BackgroundServer


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.serve_screenshot", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--image", default=None, help="default: the first example image")
    parser.add_argument("--word", type=int, default=2, help="which word to hover (from 0)")
    parser.add_argument("--out", default="docs/serve.png")
    parser.add_argument(
        "--examples",
        nargs="+",
        metavar="IMAGE",
        help="the example images the page offers (default: the checkpoint's test images)",
    )
    args = parser.parse_args()

    model = captioning.load(args.checkpoint, device="cpu")
    settings = settings_for(model, max_upload_mb=10, examples=args.examples)
    image = args.image or (settings.examples[0] if settings.examples else None)
    if image is None:
        print("error: no --image given and the checkpoint's test images are not on disk")
        return 2
    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium") or "chromium"
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--hide-scrollbars",
    ):
        options.add_argument(flag)
    with BackgroundServer(model, settings) as url:
        driver = webdriver.Chrome(options=options, service=Service(shutil.which("chromedriver")))
        try:
            # the page's size, whatever room the headless window's frame takes
            metrics = {"width": 920, "height": 760, "deviceScaleFactor": 1, "mobile": False}
            driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", metrics)
            driver.get(url)
            wait = WebDriverWait(driver, 60)
            wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#examples img"))
            driver.find_element(By.ID, "file").send_keys(str(Path(image).resolve()))
            words = wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#caption .word"))
            word = words[min(args.word, len(words) - 1)]
            driver.execute_script("arguments[0].scrollIntoView({block: 'center'})", word)
            ActionChains(driver).move_to_element(word).perform()
            wait.until(lambda d: d.find_element(By.ID, "heatmap").is_displayed())
            png = driver.get_screenshot_as_png()
            caption = " ".join(w.text for w in words)
        finally:
            driver.quit()
    shot = Image.open(io.BytesIO(png)).convert("RGB")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    # a palette keeps the file small; the page has few colours besides the heatmap
    shot.quantize(colors=256, method=Image.Quantize.MEDIANCUT).save(out, optimize=True)
    print(f"wrote {out} ({out.stat().st_size // 1024} KB): {caption}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
